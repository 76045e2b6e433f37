#!/usr/bin/env bash
# One device-machine run: GPU tests, compute-sanitizer, benchmark. Results under $OUT.
#   bash benchmarks/gpu_session.sh [--sweep] [--quick]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
SWEEP=""; QUICK=0
for a in "$@"; do case $a in --sweep) SWEEP=--sweep;; --quick) QUICK=1;; esac; done
if [ "$QUICK" = 0 ]; then
  timeout 420 python3 -m pytest -q -rs tests/test_kernels_gpu.py 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
  timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_case.py \
    > "$OUT/sanitizer.log" 2>&1; echo "compute-sanitizer exit $?" | tee -a "$OUT/sanitizer.log"
  tail -5 "$OUT/sanitizer.log"
fi
timeout 400 python3 benchmarks/bench.py $SWEEP --json "$OUT/bench.json" --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" | tail -60
