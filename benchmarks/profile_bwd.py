"""Where the backward's time goes: CUDA time per kernel (torch.profiler), both modes.

    python benchmarks/profile_bwd.py [--shapes 0,1] [--triton-main]

Same inputs as bench.py (T=4096, D=512, DeepSeek ids). Prints, per shape and mode,
each kernel's total CUDA time over one backward call.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from bench import SHAPES, backward_inputs  # noqa: E402
from dsv4_sparse_attn.kernels import backward as kbwd  # noqa: E402
from dsv4_sparse_attn.kernels import backward_gluon  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--shapes", default="0,1")
    ap.add_argument("--triton-main", action="store_true", help="the Triton main kernel, not the Gluon one")
    a = ap.parse_args()
    T, D = a.T, 512
    for i in a.shapes.split(","):
        H, K, label = SHAPES[int(i)]
        q, kv, idx, sink, out, lse, do, dl = backward_inputs(T, H, K, D)
        gluon = backward_gluon.supported(q, D, H) and not a.triton_main
        for det in (True, False):
            run = lambda: kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, D ** -0.5,
                                              deterministic=det, gluon=gluon)
            run()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            rows = [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                    if e.device_time_total > 0]
            rows.sort(key=lambda r: -r[1])
            total = sum(r[1] for r in rows)
            print(f"\n{label} H={H} K={K} {'deterministic' if det else 'atomic'}: {total:.2f} ms of kernels")
            for name, ms, n in rows[:8]:
                print(f"  {ms:8.3f} ms  {n:4d} x  {name[:90]}")


if __name__ == "__main__":
    main()
