#!/usr/bin/env bash
# Device-machine runs (results under $OUT), in parts that each fit a 10-minute call:
#   bash benchmarks/gpu_session.sh tests   # GPU tests, opcheck on CUDA, training example
#   bash benchmarks/gpu_session.sh bench   # compute-sanitizer memcheck, benchmark table, report
#   bash benchmarks/gpu_session.sh sweep   # backward side by side (with cuDNN if CUDNN_DIR
#                                          # holds cudnn_peer.py; default .peers/cudnn_dsa), report
#   bash benchmarks/gpu_session.sh triton-next  # GPU kernel tests and a quick bench under the
#                                          # Triton unpacked from .t39/triton*.tar.xz (a stripped
#                                          # cp312 wheel: docs/performance/method.md#another-triton)
# bench and sweep write benchmarks/results/*.json; report.py then rewrites README.md's
# performance section and docs/performance/bench.png. All three come back under $OUT
# (results/, README.md, bench.png): copy them into the checkout and commit them.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# Compiled kernels kept in the checkout (git-ignored): a later call on the same machine reuses them.
export TRITON_CACHE_DIR=$PWD/.cache/triton
# The image's default g++ (/opt/gcc) builds AOTInductor packages that segfault when loaded.
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"

report() {  # README section and figure from the newest results; everything back to $OUT
  timeout 60 python3 benchmarks/report.py 2>&1 | tail -3
  mkdir -p "$OUT/results"
  cp benchmarks/results/*.json "$OUT/results/" 2>/dev/null
  cp README.md "$OUT/README.md"
  cp docs/performance/bench.png "$OUT/bench.png" 2>/dev/null
}

case "${1:-tests}" in
tests)
  # The CPU-only files (expecttest is not installed there) are covered by CI.
  # (-n: the kernels compile in parallel worker processes; the GPU runs them one after another)
  timeout 420 python3 -m pytest -q -rs -n 6 -p no:cacheprovider tests/test_kernels_gpu.py tests/test_compile.py \
    tests/test_cuda_graphs.py tests/test_fsdp.py tests/test_checkpointing.py tests/test_modules.py \
    tests/test_export.py 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
  timeout 90 python3 opcheck/run_opcheck.py --device cuda 2>&1 | tail -5 | tee "$OUT/opcheck_cuda.log"
  timeout 60 python3 examples/train_block.py --steps 300 --out "$OUT/loss.png" 2>&1 | tail -5
  ;;
bench)
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_case.py \
    > "$OUT/sanitizer.log" 2>&1; echo "compute-sanitizer exit $?" | tee -a "$OUT/sanitizer.log"
  tail -5 "$OUT/sanitizer.log"
  timeout 380 python3 benchmarks/bench.py --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" | grep -v '^{'
  report
  ;;
sweep)
  CUDNN_DIR=${CUDNN_DIR:-.peers/cudnn_dsa}
  CUDNN=()
  if [ -f "$CUDNN_DIR/cudnn_peer.py" ]; then
    if [ -f "$CUDNN_DIR/install.sh" ]; then
      timeout 120 bash "$CUDNN_DIR/install.sh" > "$OUT/cudnn_install.log" 2>&1; tail -2 "$OUT/cudnn_install.log"
    fi
    CUDNN=(--cudnn "$CUDNN_DIR")
    export PYTHONPATH=/tmp/cudnn_site:$PYTHONPATH  # apache-tvm-ffi, installed there by install.sh
  fi
  timeout 480 python3 benchmarks/bench.py --backward-sweep ${CUDNN[@]+"${CUDNN[@]}"} --out "$OUT/bench_sweep.md" 2>&1 \
    | tee "$OUT/bench_sweep.log" | grep -v '^{'
  report
  ;;
triton-next)
  tarball=$(ls .t39/triton*.tar.xz 2>/dev/null | head -1)
  [ -n "$tarball" ] || { echo "no .t39/triton*.tar.xz"; exit 2; }
  mkdir -p /tmp/triton-next && tar -xJf "$tarball" -C /tmp/triton-next
  export PYTHONPATH=/tmp/triton-next:$PYTHONPATH TRITON_CACHE_DIR=$PWD/.cache/triton-next
  python3 -c "import triton; print('triton', triton.__version__, triton.__file__)" | tee "$OUT/triton_next.log"
  timeout 300 python3 -m pytest -q -rs -n 6 -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tail -15 \
    | tee -a "$OUT/triton_next.log"
  timeout 200 python3 benchmarks/bench.py --shapes 0,1,5 --no-torch --json "$OUT/bench_triton_next.json" 2>&1 \
    | grep -v '^{' | tail -12 | tee -a "$OUT/triton_next.log"
  ;;
*)
  echo "usage: bash benchmarks/gpu_session.sh tests|bench|sweep|triton-next" >&2; exit 2
  ;;
esac
