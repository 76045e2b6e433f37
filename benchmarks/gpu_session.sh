#!/usr/bin/env bash
# Device-machine runs (results under $OUT), in two parts that each fit a 10-minute call:
#   bash benchmarks/gpu_session.sh tests   # GPU tests, opcheck on CUDA, training example
#   bash benchmarks/gpu_session.sh bench   # compute-sanitizer memcheck, benchmark table
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
case "${1:-tests}" in
tests)
  # The CPU-only files (expecttest is not installed there) are covered by CI.
  timeout 420 python3 -m pytest -q -rs tests/test_kernels_gpu.py tests/test_compile.py \
    tests/test_cuda_graphs.py tests/test_fsdp.py tests/test_checkpointing.py tests/test_modules.py \
    2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
  timeout 90 python3 opcheck/run_opcheck.py --device cuda 2>&1 | tail -5 | tee "$OUT/opcheck_cuda.log"
  timeout 60 python3 examples/train_block.py --steps 300 --out "$OUT/loss.png" 2>&1 | tail -5
  ;;
bench)
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_case.py \
    > "$OUT/sanitizer.log" 2>&1; echo "compute-sanitizer exit $?" | tee -a "$OUT/sanitizer.log"
  tail -4 "$OUT/sanitizer.log"
  timeout 400 python3 benchmarks/bench.py --json "$OUT/bench.json" --out "$OUT/bench.md" 2>&1 \
    | tee "$OUT/bench.log" | grep -v '^{"label'
  ;;
esac
