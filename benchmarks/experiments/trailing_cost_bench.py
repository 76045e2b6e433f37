"""Where the forward's trailing option costs time when every slot is valid: the launch that
finds the lengths (``common.trailing_lengths``) alone, and the forward with and without the
option, A, B, B, A in one process (distinct pool ids, T = 4096).

    PYTHONPATH=src:tests:benchmarks/experiments python benchmarks/experiments/trailing_cost_bench.py

Why: trailing_skip_bench.py (H100, 353b1b5) read the option's forward 7-9% slower at
H64 K640 and H128 K512 where every slot is valid, against a prediction of under 1%.
Prediction: the launch is a few microseconds (under 1% of a 0.7 ms forward), so the rest
is the ``HAS_LEN`` 2 build's own per-tile cost.
"""
import json

import triton

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import forward_gluon
from dsv4_sparse_attn.kernels.common import trailing_lengths
from side_by_side import pool_inputs, with_flags

for T, H, K in ((4096, 64, 640), (4096, 128, 512), (4096, 128, 1152), (4096, 64, 160)):
    D = 512
    q, kv, idx, sink, do, out, lse = pool_inputs(T, H, K, "distinct")
    N = kv.shape[0]
    r = dict(T=T, H=H, K=K)

    def fwd(on):
        return with_flags(forward_gluon, lambda: forward_gluon.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5),
                          TRAILING_MASKED_SKIPPED=on)

    arms = (("off", fwd(False)), ("on", fwd(True)), ("lengths", lambda: trailing_lengths(idx, N)))
    for k in range(2):
        for label, f in (arms if k == 0 else arms[::-1]):
            ms = triton.testing.do_bench(f, warmup=3, rep=100, return_mode="median")
            r[f"{label}_ms_{k}"] = round(ms, 4)
    best = {a: min(r[f"{a}_ms_{k}"] for k in range(2)) for a, _ in arms}
    r["on_minus_off_ms"] = round(best["on"] - best["off"], 4)
    r["lengths_ms"] = best["lengths"]
    print(json.dumps(r), flush=True)
