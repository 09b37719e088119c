#!/bin/bash
# The device check, on a machine with one NVIDIA GPU whose python3 has CUDA torch, triton and
# transformers, and no network: installs the pure-Python and small binary dependencies it lacks
# from .whl/ (fetched beforehand by `make gpu-wheels` on a machine with an index), runs the
# CUDA tests (tests/test_cuda.py, tests/test_triton_attention.py on CUDA tensors) and the CUDA
# graph bookkeeping tests, then scripts/bench_gpu.py, and writes the test log and the
# benchmark's JSON into OUT_DIR.
#   scripts/gpu_check.sh [--device cuda|cpu] [--quick] OUT_DIR
# --quick: the benchmark at its small sizes (a dry run: its figures mean nothing).
# --device cpu --quick: the same check on a machine without a GPU, in $PYTHON (default python3)
#   as it is, without the wheels: the CUDA tests skip, the Triton kernels run under Triton's
#   interpreter, the benchmark runs on the CPU. A couple of minutes; checks the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda QUICK=0 OUT_DIR=
while (($#)); do
  case $1 in
    --device) DEVICE=${2:-}; shift $(($# > 1 ? 2 : 1)) ;;
    --device=*) DEVICE=${1#*=}; shift ;;
    --quick) QUICK=1; shift ;;
    -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
    *) OUT_DIR=$1; shift ;;
  esac
done
[ -n "$OUT_DIR" ] || { echo "usage: scripts/gpu_check.sh [--device cuda|cpu] [--quick] OUT_DIR" >&2; exit 2; }
case $DEVICE in
  cuda) ;;
  cpu) ((QUICK)) || { echo "gpu_check: --device cpu runs only with --quick (the full benchmark is sized for a GPU)" >&2; exit 2; } ;;
  *) echo "gpu_check: --device is cuda or cpu, not '$DEVICE'" >&2; exit 2 ;;
esac
mkdir -p "$OUT_DIR"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ "$DEVICE" = cuda ]; then
  SITE=${LLMSERVE_GPU_SITE:-/tmp/llmserve-gpu-site}
  # the tests and the benchmark import none of the server's packages; the wheels serve `llmserve serve`
  shopt -s nullglob
  wheels=(.whl/*.whl)
  if ((${#wheels[@]})); then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" || exit 1
  fi
  export PYTHONPATH="$SITE:$PWD"
  unset TRITON_INTERPRET
  "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 1
else
  # the wheels are for the GPU image's Python; this one runs the project's own environment
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUDA_VISIBLE_DEVICES=""
  "$PYTHON" -c "import torch; print(torch.__version__, 'cpu (CUDA tests skip; Triton kernels under its interpreter)')" || exit 1
fi
# a hard limit: pytest-timeout may be missing there, and a hang would spend the device's time
timeout 420 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="-ra" \
  tests/test_triton_attention.py tests/test_cuda.py tests/test_cuda_graph_buckets.py 2>&1 | tee "$OUT_DIR/tests.log"
tests=${PIPESTATUS[0]}
bench_args=(--device "$DEVICE" --json "$OUT_DIR/bench_gpu.json")
((QUICK)) && bench_args+=(--quick)
timeout 300 "$PYTHON" scripts/bench_gpu.py "${bench_args[@]}" 2>&1 | tee "$OUT_DIR/bench.log"
bench=${PIPESTATUS[0]}
echo "gpu_check ($DEVICE$( ((QUICK)) && echo ', quick')): tests exit $tests, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
