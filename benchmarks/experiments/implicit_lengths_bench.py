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
from side_by_side import pool_inputs, relerr

ROWS = [(4096, 64, 640, "causal"), (4096, 128, 1152, "causal"), (4096, 64, 640, "distinct"),
        (4096, 128, 1152, "distinct"), (4096, 64, 160, "random"), (131072, 64, 640, "causal")]
ROWS = [ROWS[int(i)] for i in os.environ.get("EFF_ROWS", "0,1,2,3,4,5").split(",")]


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

    def fwd(with_len):
        return lambda: torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, scale,
                                                     trailing_length(idx, N) if with_len else None)

    def bwd(with_len, det):
        def run():
            dsv4_sparse_attn.set_deterministic_backward(det)
            try:
                return torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale,
                                                     trailing_length(idx, N) if with_len else None)
            finally:
                dsv4_sparse_attn.set_deterministic_backward(None)
        return run

    pairs = {"fwd": (fwd(False), fwd(True)), "fast": (bwd(False, False), bwd(True, False)),
             "det": (bwd(False, True), bwd(True, True))}
    if T > 32768:
        pairs.pop("det")  # (its partial rows' chunks: a minute a call pair at this size)
    for name, (a, b) in pairs.items():
        x, y = a(), b()
        if name == "fwd":
            r["fwd_err_out"] = relerr(y[0].float(), x[0].float())
            r["fwd_lse_equal"] = bool(torch.equal(x[1], y[1]))
        else:
            r[f"{name}_err_dq"] = relerr(y[0].float(), x[0].float())
            r[f"{name}_err_dkv"] = relerr(y[1].float(), x[1].float())
            if name == "det":
                r["det_bitwise"] = all(torch.equal(u, v) for u, v in zip(x, y))
        x = y = None
        rep = 300 if T > 32768 else 100
        for k in range(2):  # A, B, B, A
            order = ((name, a), (name + "_len", b)) if k == 0 else ((name + "_len", b), (name, a))
            for label, f in order:
                ms = triton.testing.do_bench(f, warmup=3, rep=rep, return_mode="median")
                r[f"{label}_ms_{k}"] = round(ms, 4)
        best = min(r[f"{name}_ms_0"], r[f"{name}_ms_1"])
        best_len = min(r[f"{name}_len_ms_0"], r[f"{name}_len_ms_1"])
        r[f"{name}_len_over_none"] = round(best_len / best, 4)
    print(json.dumps(r), flush=True)
    q = kv = idx = out = lse = do = eff = None
    torch.cuda.empty_cache()
