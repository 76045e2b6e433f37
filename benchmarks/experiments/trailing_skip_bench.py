"""The forward (``forward_gluon.TRAILING_MASKED_SKIPPED``: a launch finds the lengths) and the
backward's main kernel leaving out each token's trailing masked slots
(``backward.TRAILING_MASKED_SKIPPED``: the Delta launch finds them, the Gluon main kernel
takes them as lengths in token order) against the shipped call, A, B, B, A in one process,
both modes.

    PYTHONPATH=src:tests:benchmarks/experiments python benchmarks/experiments/trailing_skip_bench.py

Why: a causal indexer's ids end in -1 until its pool fills; without lengths the main kernel
runs those blocks masked. Measured first with the lengths found by a launch of their own
(implicit_lengths_bench.py, H200, e67ad72: 27-32% less time at H128 K1152 with causal ids at
T = 4096, 7% at H64 K640 in token order; but 2-5% more where every slot is valid, and
1.1-1.5x at the host-bound K = 160, from the extra launches).
Prediction (forward, its lengths from a launch of its own, in token order): the causal rows
as implicit_lengths_bench.py's in-order forward (-30% at H128 K1152, -7% at H64 K640); where
every slot is valid the launch's few microseconds (under 1% but at K = 160).
Prediction (backward): with the lengths from the Delta launch (no launch more, no schedule) the causal
rows as there in token order; where every slot is valid within 1% (the tiles' lengths
loaded, the remainder's tiles whole: 0.1-1.5% by their measurement), the host-bound rows too.
Then (4d98ad8) the remainder's tiles in a parts launch of their own: where every slot is
valid the option within the noise of the call without it (the parts' 1.5% at H64 K640 back);
the causal rows unchanged (the remainder's tiles are the last tokens, whose pools are full).
"""
import json
import os

import torch
import triton

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon, forward_gluon
from side_by_side import pool_inputs, relerr, with_flags

ROWS = [(4096, 64, 640, "causal"), (4096, 128, 1152, "causal"), (4096, 64, 640, "distinct"),
        (4096, 128, 1152, "distinct"), (4096, 64, 160, "random"), (4096, 16, 1152, "distinct"),
        (4096, 128, 512, "distinct"), (32768, 64, 640, "distinct")]
ROWS = [ROWS[int(i)] for i in os.environ.get("TRAIL_ROWS", "0,1,2,3,4,5,6,7").split(",")]
REPS = int(os.environ.get("TRAIL_REPS", "2"))
# TRAIL_NO_PARTS=1: two more arms, the fast mode without the remainder's parts, without and
# with the option (with it, by default, the whole rounds take the lengths and the remainder's
# tiles a launch of their own in parts: backward_gluon.launch(in_order=True))
NO_PARTS = os.environ.get("TRAIL_NO_PARTS") == "1"
# TRAIL_NO_PDL=1: one more arm, the option with the remainder's launch started only once the
# whole rounds' launch has ended (``backward_gluon.launch(pdl=False)``), as before
# ``REMAINDER_PDL``. Prediction (H100, 5a5f469: with that launch the option cost 1-3.3% where
# every slot is valid, and without parts at all it was level with the call without parts):
# with the early start the option within 0.5% of the call without it there, the causal rows
# as before or better
NO_PDL = os.environ.get("TRAIL_NO_PDL") == "1"

for T, H, K, ids in ROWS:
    D = 512
    q, kv, idx, sink, do, out, lse = pool_inputs(T, H, K, ids)
    N = kv.shape[0]
    valid = ((idx >= 0) & (idx < N)).float().mean().item()
    r = dict(T=T, H=H, K=K, D=D, ids=ids, valid_slots=round(valid, 4))

    def arm(det, on, **opts):
        return with_flags(kbwd, lambda: kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5,
                                                            main=backward_gluon, deterministic=det, **opts),
                          TRAILING_MASKED_SKIPPED=on)

    def fwd(on):  # the Gluon forward with and without its option (forward_gluon.TRAILING_MASKED_SKIPPED)
        return with_flags(forward_gluon, lambda: forward_gluon.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5),
                          TRAILING_MASKED_SKIPPED=on)

    x, y = fwd(False)(), fwd(True)()
    r["fwd_bitwise"] = torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    x = y = None
    for k in range(REPS):
        pair = (("fwd", fwd(False)), ("fwd_skip", fwd(True)))
        for label, f in (pair if k % 2 == 0 else pair[::-1]):
            ms = triton.testing.do_bench(f, warmup=3, rep=100, return_mode="median")
            r[f"{label}_ms_{k}"] = round(ms, 4)
    r["fwd_skip_over_none"] = round(min(r[f"fwd_skip_ms_{k}"] for k in range(REPS))
                                    / min(r[f"fwd_ms_{k}"] for k in range(REPS)), 4)

    if NO_PARTS:  # the fast mode without the remainder's parts, without and with the option
        for label, on in (("fast_noparts", False), ("fast_skip_noparts", True)):
            c = arm(False, on, split_remainder=False)
            for k in range(REPS):
                r[f"{label}_ms_{k}"] = round(triton.testing.do_bench(c, warmup=3, rep=100,
                                                                     return_mode="median"), 4)

    if NO_PDL:
        c = arm(False, True, pdl=False)
        for k in range(REPS):
            ms = triton.testing.do_bench(c, warmup=3, rep=100, return_mode="median")
            r[f"fast_skip_nopdl_ms_{k}"] = round(ms, 4)

    for mode, det in (("fast", False), ("det", True)):
        a, b = arm(det, False), arm(det, True)
        x, y = a(), b()
        r[f"{mode}_err_dq"] = relerr(y[0].float(), x[0].float())
        r[f"{mode}_err_dkv"] = relerr(y[1].float(), x[1].float())
        r[f"{mode}_bitwise"] = all(torch.equal(u, v) for u, v in zip(x, y))
        x = y = None
        for k in range(REPS):
            pair = ((mode, a), (mode + "_skip", b))
            for label, f in (pair if k % 2 == 0 else pair[::-1]):
                ms = triton.testing.do_bench(f, warmup=3, rep=100, return_mode="median")
                r[f"{label}_ms_{k}"] = round(ms, 4)
        best = min(r[f"{mode}_ms_{k}"] for k in range(REPS))
        best_skip = min(r[f"{mode}_skip_ms_{k}"] for k in range(REPS))
        r[f"{mode}_skip_over_none"] = round(best_skip / best, 4)
    print(json.dumps(r), flush=True)
    q = kv = idx = out = lse = do = None
    torch.cuda.empty_cache()
