"""A small forward + backward with out-of-range, negative and extreme ids, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 9 python benchmarks/sanitize_case.py

T=37 tokens, N=50 kv rows, K=77 slots with ids drawn from [-N, 2N), a column of 2**31 - 1, one
of -2**31 and a token whose ids are all -1; H in (128, 100, 16) at D=512, H=5 at D=128 and the
576/512 layout (``d_v=512``) at H=64, 128 and 24 (a 32-head tile); per-token lengths drawn
from [-2, K + 3] at H=100 and in the 576/512 cases. Every forward kernel ("gluon_sm90",
"triton") and, in both backward modes, every backward main kernel that takes the call runs
it (``use_kernels``); the outputs must be finite. The sanitizer reports any out-of-bounds access.
"""
from __future__ import annotations

import argparse

import torch

import dsv4_sparse_attn
from bench import backward_mode, rejection, require_cuda

KERNELS = ("gluon_sm90", "triton")
CASES = ((128, 512, None, False), (100, 512, None, True), (16, 512, None, False), (5, 128, None, False),
         (64, 576, 512, True), (128, 576, 512, True), (24, 576, 512, True))  # (H, D, d_v, per-token lengths)


def main():
    ap = argparse.ArgumentParser(description="Forward and backward of every kernel on out-of-range, negative "
                                             "and extreme ids (run it under compute-sanitizer).")
    ap.parse_args()
    require_cuda("sanitize_case.py")
    T, N, K = 37, 50, 77
    torch.manual_seed(0)
    for H, D, d_v, lengths in CASES:
        scale = D ** -0.5
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        idx = torch.randint(-N, 2 * N, (T, K), device="cuda", dtype=torch.int32)
        idx[:, 0] = 2**31 - 1
        idx[:, 1] = -(2**31)
        idx[3] = -1
        sink = torch.randn(H, device="cuda")
        length = None
        if lengths:
            length = torch.randint(-2, K + 4, (T,), device="cuda", dtype=torch.int32)
        extra = (length, d_v)
        ran, outs = [], {}
        for name in KERNELS:
            why = rejection("forward", name, q, d_v=d_v, has_len=length is not None)
            if why:
                ran.append(f"fwd {name}: not run ({why})")
                continue
            with dsv4_sparse_attn.use_kernels(forward=name):
                outs[name] = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, scale, *extra)
            assert all(torch.isfinite(x).all() for x in outs[name]), f"forward {name}: not finite"
            ran.append(f"fwd {name}")
        out, lse = outs["triton"]  # the Triton forward takes every case
        do, dl = torch.randn_like(out), torch.randn_like(lse)
        for det in (True, False):
            mode = "deterministic" if det else "fast"
            with backward_mode(det):
                for name in KERNELS:
                    why = rejection("backward", name, q, det, d_v=d_v, has_len=length is not None)
                    if why:
                        ran.append(f"bwd {mode} {name}: not run ({why})")
                        continue
                    with dsv4_sparse_attn.use_kernels(backward=name):
                        g = torch.ops.dsv4.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, scale, *extra)
                    assert all(torch.isfinite(x).all() for x in g), f"backward {mode} {name}: not finite"
                    ran.append(f"bwd {mode} {name}")
        torch.cuda.synchronize()
        print(f"H {H} D {D} d_v {d_v or D} lengths {lengths} ok: " + "; ".join(ran), flush=True)


if __name__ == "__main__":
    main()
