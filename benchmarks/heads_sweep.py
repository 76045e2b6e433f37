"""Triton against Gluon kernels by head count: the data behind the dispatcher's head rules.

    python benchmarks/heads_sweep.py [--T 4096] [--heads 1,4,8,16,24,32,48] [--K 1152,512]

bench.py's inputs (D=512, DeepSeek ids, seed 0). Prints ms (TFLOPS: forward 4*T*H*K*D,
backward 10*T*H*K*D) of the forward and of both backward modes with each kernel forced
through ``dsv4_sparse_attn.use_kernels``. A forced kernel runs only the calls its rule
takes: a cell whose kernel rejects the call shows "-", with the reason under the table
(the Gluon forward takes H >= forward_gluon.MIN_HEADS; to time it below that, lower the
constant in a local checkout).
"""
from __future__ import annotations

import argparse

import torch

import dsv4_sparse_attn
from bench import backward_inputs, backward_mode, bench, rejection, require_cuda

KERNELS = ("triton", "gluon_sm90")
WARMUP_MS, REP_MS = 25, 50


def row(T, H, K, D, reasons):
    """The table cells of one (H, K): forward, then deterministic and fast backward, each
    with the Triton and the Gluon kernel."""
    q, kv, idx, sink, out, lse, do, dl = backward_inputs(T, H, K, D)
    scale = D ** -0.5

    def cell(direction, name, fn, flops, det=True):
        why = rejection(direction, name, q, det)
        if why:
            reasons.setdefault(f"{direction} {name}: {why}", []).append(f"H{H} K{K}")
            return "-"
        with dsv4_sparse_attn.use_kernels(**{direction: name}):
            ms = bench(fn, WARMUP_MS, REP_MS)
        return f"{ms:.3f} ({flops / ms * 1e-9:.0f})"

    fwd = lambda: torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, scale)  # noqa: E731
    bwd = lambda: torch.ops.dsv4.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, scale)  # noqa: E731
    cells = [cell("forward", name, fwd, 4 * T * H * K * D) for name in KERNELS]
    for det in (True, False):
        with backward_mode(det):
            cells += [cell("backward", name, bwd, 10 * T * H * K * D, det) for name in KERNELS]
    return cells


def main():
    ap = argparse.ArgumentParser(description="Triton against Gluon kernels by head count (forward and both "
                                             "backward modes), D=512.")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--heads", default="1,4,8,16,24,32,48")
    ap.add_argument("--K", default="1152,512")
    a = ap.parse_args()
    require_cuda("heads_sweep.py")
    print("| H | K | fwd Triton | fwd Gluon | bwd det Triton | bwd det Gluon | bwd fast Triton "
          "| bwd fast Gluon |  (ms, TFLOPS)")
    print("|---" * 8 + "|")
    reasons = {}
    for K in map(int, a.K.split(",")):
        for H in map(int, a.heads.split(",")):
            print(f"| {H} | {K} | " + " | ".join(row(a.T, H, K, 512, reasons)) + " |", flush=True)
            torch.cuda.empty_cache()
    for why, where in reasons.items():
        print(f"- {why} ({', '.join(where)})")


if __name__ == "__main__":
    main()
