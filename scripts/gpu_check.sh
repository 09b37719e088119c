#!/bin/bash
# The device check, on a machine with one NVIDIA GPU whose python3 has CUDA torch, triton and
# transformers, and no network: installs the pure-Python and small binary dependencies it lacks
# from .whl/ (fetched beforehand by `make gpu-wheels` on a machine with an index), runs the
# CUDA tests (tests/test_cuda.py, and tests/test_triton_attention.py on CUDA tensors), then
# scripts/bench_gpu.py, and writes the test log and the benchmark's JSON into OUT_DIR.
#   scripts/gpu_check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT_DIR"
SITE=${LLMSERVE_GPU_SITE:-/tmp/llmserve-gpu-site}
# the tests and the benchmark import none of the server's packages; the wheels serve `llmserve serve`
shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})); then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" || exit 1
fi
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 1
# a hard limit: pytest-timeout may be missing there, and a hang would spend the device's time
timeout 420 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_triton_attention.py tests/test_cuda.py 2>&1 | tee "$OUT_DIR/tests.log"
tests=${PIPESTATUS[0]}
timeout 300 python3 scripts/bench_gpu.py --json "$OUT_DIR/bench_gpu.json" 2>&1 | tee "$OUT_DIR/bench.log"
bench=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
