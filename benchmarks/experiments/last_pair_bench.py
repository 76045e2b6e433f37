"""The Gluon forward with lengths, its tile's last block pair inside the loop (the shipped
``DEAD`` build: a branch for the dead odd block in consumer 1's loop) or apart from it
(``forward_gluon.PEEL_LAST_PAIR``), A, B, B, A in one process, next to the full-K call.

    PYTHONPATH=src:tests:benchmarks/experiments python benchmarks/experiments/last_pair_bench.py

Arms per shape (T = 4096, distinct pool ids): ``full`` (no lengths), lengths uniform in
[128, K] (seed 1, their balanced order: the features issue's ratio) with the pair in the
loop and apart, and the trailing option (``TRAILING_MASKED_SKIPPED``, lengths in token
order, here every slot valid) in and apart.

Why: the lengths builds' consumer 1 loop is 1032 instructions against 839 without lengths
(the dead-block branch duplicates the pair's code), and the trailing option's forward cost
5% beyond its launch where every slot is valid at H64 K640 (H100, 5a5f469). Apart, the
loops are 803-819 (sm_90, Triton 3.6). Prediction: where the forward's consumer 1 issue
bounds it, up to 5% less time with lengths: the option's cost where every slot is valid
down to its launch (1.5% at H64 K640), and the uniform lengths' ratio to full K (0.75 at
K = 640) a few points lower; nothing at H = 128, where the tensor work bounds the call.
The outputs of the two builds bitwise equal (checked first).
"""
import json

import torch
import triton

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import forward_gluon
from side_by_side import pool_inputs, with_flags

for T, H, K in ((4096, 64, 640), (4096, 128, 1152), (4096, 64, 2048), (4096, 128, 512)):
    D = 512
    q, kv, idx, sink, do, out, lse = pool_inputs(T, H, K, "distinct")
    g = torch.Generator(device="cuda").manual_seed(1)
    length = torch.randint(128, K + 1, (T,), device="cuda", dtype=torch.int32, generator=g)
    r = dict(T=T, H=H, K=K)

    def fwd(peel, lengths=None, trailing=False):
        def run():
            return forward_gluon.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5, topk_length=lengths)
        return with_flags(forward_gluon, run, PEEL_LAST_PAIR=peel, TRAILING_MASKED_SKIPPED=trailing)

    arms = (("full", fwd(False)), ("len", fwd(False, length)), ("len_apart", fwd(True, length)),
            ("trail", fwd(False, trailing=True)), ("trail_apart", fwd(True, trailing=True)))
    for a, b in (("len", "len_apart"), ("trail", "trail_apart")):
        x, y = dict(arms)[a](), dict(arms)[b]()
        r[f"{b}_bitwise"] = torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    for k in range(2):
        for label, f in (arms if k == 0 else arms[::-1]):
            ms = triton.testing.do_bench(f, warmup=3, rep=100, return_mode="median")
            r[f"{label}_ms_{k}"] = round(ms, 4)
    best = {a: min(r[f"{a}_ms_{k}"] for k in range(2)) for a, _ in arms}
    for a in ("len", "len_apart", "trail", "trail_apart"):
        r[f"{a}_over_full"] = round(best[a] / best["full"], 4)
    print(json.dumps(r), flush=True)
