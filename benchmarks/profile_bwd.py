"""Where the backward's time goes: CUDA time per kernel (torch.profiler), both modes.

    python benchmarks/profile_bwd.py [--T 4096] [--shapes 0,1] [--triton-main]

bench.py's inputs (D=512, DeepSeek ids, seed 0) and shapes (--shapes: row numbers of
bench.SHAPES). Prints, per shape and mode, each GPU kernel's total time over one
``torch.ops.dsv4.sparse_mla_bwd`` call: the main kernel the dispatcher picks, or the
Triton one with --triton-main (``use_kernels(backward="triton")``).
"""
from __future__ import annotations

import argparse
import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

import dsv4_sparse_attn
from bench import SHAPES, backward_inputs, backward_mode, kernel_name, require_cuda


def main():
    ap = argparse.ArgumentParser(description="CUDA time per kernel of one backward call, both modes.")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--shapes", default="0,1", help=f"rows of bench.SHAPES (0-{len(SHAPES) - 1})")
    ap.add_argument("--triton-main", action="store_true", help="the Triton main kernel, not the default one")
    a = ap.parse_args()
    require_cuda("profile_bwd.py")
    T, D = a.T, 512
    forced = dsv4_sparse_attn.use_kernels(backward="triton") if a.triton_main else contextlib.nullcontext()
    with forced:
        for i in a.shapes.split(","):
            H, K, label = SHAPES[int(i)]
            q, kv, idx, sink, out, lse, do, dl = backward_inputs(T, H, K, D)
            for det in (True, False):
                with backward_mode(det):
                    run = lambda: torch.ops.dsv4.sparse_mla_bwd(  # noqa: E731
                        do, dl, q, kv, out, lse, idx, sink, D ** -0.5)
                    run()
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        run()
                        torch.cuda.synchronize()
                    main_kernel = kernel_name("backward", q, det)
                rows = [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                        if e.device_time_total > 0]
                rows.sort(key=lambda r: -r[1])
                total = sum(r[1] for r in rows)
                mode = "deterministic" if det else "fast"
                print(f"\n{label} H={H} K={K} {mode} (main kernel {main_kernel}): {total:.2f} ms of kernels")
                for name, ms, n in rows[:8]:
                    print(f"  {ms:8.3f} ms  {n:4d} x  {name[:90]}")


if __name__ == "__main__":
    main()
