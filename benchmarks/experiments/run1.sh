#!/usr/bin/env bash
# Device run: dKV accumulation modes next to cuDNN, reduction probe, Triton 3.9 import check.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv | tee "$OUT/smi.txt"
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
timeout 120 bash .peers/cudnn_dsa/install.sh > "$OUT/cudnn_install.log" 2>&1; tail -2 "$OUT/cudnn_install.log"
PYTHONPATH=/tmp/cudnn_site:src:benchmarks/experiments timeout 420 python3 benchmarks/experiments/dkv_modes_bench.py .peers/cudnn_dsa 2>&1 | tee "$OUT/dkv_modes.log" | grep -v "^WARNING"
mkdir -p /tmp/t39 && tar -xJf .t39/triton39.tar.xz -C /tmp/t39
cat > /tmp/t39_check.py <<'PY'
import torch, triton, triton.language as tl
print("triton", triton.__version__, triton.__file__)
@triton.jit
def k(X, n):
    i = tl.arange(0, 128)
    tl.store(X + i, tl.load(X + i) + n)
x = torch.zeros(128, device="cuda")
k[(1,)](x, 3)
torch.cuda.synchronize()
print("3.9 kernel ran:", bool((x == 3).all()))
PY
PYTHONPATH=/tmp/t39 timeout 120 python3 /tmp/t39_check.py 2>&1 | grep -v FP_FUSION | tail -5 | tee "$OUT/t39.log"
