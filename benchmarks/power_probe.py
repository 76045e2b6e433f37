"""Clocks and power while one workload runs (is the backward power-bound?), or a few calls
of it for Nsight Compute.

    python benchmarks/power_probe.py bwd --H 64 --K 640     # DSV4_BWD_DIAG=1: no dKV stores
    ncu --section WarpStateStats -k regex:_bwd_main_gluon --launch-skip 3 --launch-count 1 \
        python benchmarks/power_probe.py bwd --H 64 --K 640 --calls 2

Prints the median SM clock, power draw and throttle reasons sampled by nvidia-smi every
50 ms over ~3 s of back-to-back calls (fwd, bwd: bench.py's inputs; store: a 2 GiB
fill_), and the time per call.
"""
import argparse
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench import backward_inputs  # noqa: E402
from dsv4_sparse_attn.kernels import backward as kbwd, forward_gluon  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["bwd", "fwd", "store"])
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--K", type=int, default=640)
    ap.add_argument("--calls", type=int, default=0, help="only make this many calls (for ncu), no sampling")
    a = ap.parse_args()
    what, H, K = a.what, a.H, a.K
    T, D = 4096, 512
    q, kv, idx, sink, out, lse, do, dl = backward_inputs(T, H, K, D)
    scale = D ** -0.5
    if what == "bwd":
        fn = lambda: kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, scale, gluon=True)
    elif what == "fwd":
        fn = lambda: forward_gluon.sparse_mla_fwd(q, kv, idx, sink, scale)
    else:
        buf = torch.empty(2 ** 30 // 4 * 2, device="cuda")
        fn = lambda: buf.fill_(1.0)
    for _ in range(a.calls or 3):
        fn()
    torch.cuda.synchronize()
    if a.calls:
        return
    mon = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                            "clocks_event_reasons.active", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    t0 = time.time()
    n = 0
    while time.time() - t0 < 3.0:
        fn()
        n += 1
        if n % 4 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    dt = (time.time() - t0) / n
    mon.terminate()
    rows = [r.split(", ") for r in mon.stdout.read().strip().splitlines()]
    rows = rows[len(rows) // 5:]  # skip the ramp
    med = lambda i: sorted(float(r[i]) for r in rows)[len(rows) // 2]
    reasons = sorted({r[4] for r in rows})
    print(f"{what} H{H} K{K} diag={os.environ.get('DSV4_BWD_DIAG', '0')}: {dt * 1e3:.3f} ms/call, "
          f"SM {med(0):.0f} MHz, mem {med(1):.0f} MHz, {med(2):.0f} W, {med(3):.0f} C, reasons {reasons}")


if __name__ == "__main__":
    main()
