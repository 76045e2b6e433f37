"""Calls without ``topk_length`` given each token's trailing run of masked slots as a length:
``eff[t] = 1 + the last slot j with 0 <= ids[t, j] < N`` (0 if none), passed as ``topk_length``,
against the same call without lengths, A, B, B, A in one process; the forward and both
backward modes.

    PYTHONPATH=src:tests:benchmarks/experiments python benchmarks/experiments/implicit_lengths_bench.py

Why: a causal indexer's ids end in -1 where the compressed pool is still short (token t has
min(t / 4, K - 128) pool rows). At T = 4096 that is 20% of the slots at K = 640 and 44% at
K = 1152 (its 1,024 pool slots fill only at t = 4096), and the kernels without lengths visit
those blocks: they skip only the masked slots' reductions. With lengths the Gluon kernels
visit the blocks within the length. A masked slot adds nothing, so the results are the same
(the fast mode up to its order of fp32 additions; the deterministic mode bitwise).
Measured first in pool_passes_bench.py (H100, 65d831b): the fast main kernel at T = 4096 H64
K640 causal 2.009 ms without lengths, 1.73 with them.

Prediction (T = 4096, causal ids): the fast backward's main kernel in proportion to the
blocks visited, the fixed parts unchanged: -14% at H64 K640, -35% at H128 K1152; the forward
about as much; T = 131072 causal unchanged (0.8% of its slots masked); distinct ids (every
slot valid) unchanged but for the lengths' own cost (their build, the length-balanced order's
sort and the eff kernel: a few microseconds of GPU time, some 10 launches of host time).
"""
import json
import os

import torch
import triton

import dsv4_sparse_attn
from dsv4_sparse_attn.kernels import backward_gluon, forward_gluon
from dsv4_sparse_attn.kernels.common import trailing_lengths
from side_by_side import in_order, kernel_ms, pool_inputs, relerr

ROWS = [(4096, 64, 640, "causal"), (4096, 128, 1152, "causal"), (4096, 64, 640, "distinct"),
        (4096, 128, 1152, "distinct"), (4096, 64, 160, "random"), (131072, 64, 640, "causal")]
ROWS = [ROWS[int(i)] for i in os.environ.get("EFF_ROWS", "0,1,2,3,4").split(",")]
# EFF_ARMS: "len" (the lengths' balanced order) and / or "inorder" (the tokens in their order)
ARMS = os.environ.get("EFF_ARMS", "inorder,len").split(",")


def trailing_length_kernel(idx, N):  # (since faa4c95 the library's launch)
    return trailing_lengths(idx, N)


def ordered(run, inorder):
    def go():
        if not inorder:
            return run()
        saved = forward_gluon.balanced_order, backward_gluon.balanced_order
        forward_gluon.balanced_order = backward_gluon.balanced_order = in_order
        try:
            return run()
        finally:
            forward_gluon.balanced_order, backward_gluon.balanced_order = saved
    return go


def trailing_length(idx, N):
    """int32 [T]: 1 + the last valid slot of each token (0 where none is valid)."""
    valid = (idx >= 0) & (idx < N)
    pos = torch.arange(1, idx.shape[1] + 1, device=idx.device, dtype=torch.int32)
    return torch.where(valid, pos, 0).amax(1).to(torch.int32)


for T, H, K, ids in ROWS:
    D = 512
    scale = D ** -0.5
    q, kv, idx, sink, do, out, lse = pool_inputs(T, H, K, ids)
    N = kv.shape[0]
    eff = trailing_length(idx, N)
    valid = ((idx >= 0) & (idx < N)).float().mean().item()
    r = dict(T=T, H=H, K=K, D=D, ids=ids, N=N, valid_slots=round(valid, 4),
             eff_mean=round(eff.float().mean().item() / K, 4))

    assert torch.equal(eff, trailing_length_kernel(idx, N))

    def fwd(with_len):
        return lambda: torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, scale,
                                                     trailing_length_kernel(idx, N) if with_len else None)

    def bwd(with_len, det):
        def run():
            dsv4_sparse_attn.set_deterministic_backward(det)
            try:
                return torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale,
                                                     trailing_length_kernel(idx, N) if with_len else None)
            finally:
                dsv4_sparse_attn.set_deterministic_backward(None)
        return run

    makers = (("fwd", lambda w: fwd(w)), ("fast", lambda w: bwd(w, False)), ("det", lambda w: bwd(w, True)))
    for name, make in makers:
        arms = {name: make(False)}
        for a in ARMS:
            arms[f"{name}_{a}"] = ordered(make(True), a == "inorder")
        x = arms[name]()
        for label, f in arms.items():
            if label == name:
                continue
            y = f()
            if name == "fwd":
                r[f"{label}_err_out"] = relerr(y[0].float(), x[0].float())
            else:
                r[f"{label}_err_dkv"] = relerr(y[1].float(), x[1].float())
            r[f"{label}_bitwise"] = all(torch.equal(u, v) for u, v in zip(x, y))
            y = None
        x = None
        names = list(arms)
        for k in range(2):  # A, B, ..., B, A
            for label in (names if k == 0 else names[::-1]):
                ms = triton.testing.do_bench(arms[label], warmup=3, rep=100, return_mode="median")
                r[f"{label}_ms_{k}"] = round(ms, 4)
        for label in names:
            r[f"{label}_ms"] = min(r[f"{label}_ms_0"], r[f"{label}_ms_1"])
            r[f"{label}_kernel_other_ms"] = kernel_ms(arms[label], ("bwd_main", "fwd_gluon"))
            if label != name:
                r[f"{label}_over_none"] = round(r[f"{label}_ms"] / r[f"{name}_ms"], 4)
    print(json.dumps(r), flush=True)
    q = kv = idx = out = lse = do = eff = None
    torch.cuda.empty_cache()
