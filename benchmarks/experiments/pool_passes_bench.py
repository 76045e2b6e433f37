"""The fast backward at long contexts split into passes by kv row range: each pass takes every
token's slots whose ids fall in its range (the window rows in the first pass, the pool cut
into ``P`` equal ranges), compacted to the front of the token's ids with ``topk_length`` the
count, so a pass's reductions and gathers touch 1/P of the pool's accumulator and rows.

    PYTHONPATH=src:tests:benchmarks/experiments python benchmarks/experiments/pool_passes_bench.py

Why: at T = 131072 with causal ids the fast mode keeps 0.64 (H100) / 0.78 (H200) of its
T = 4096 TFLOPS; its pool accumulator (32,768 rows x 2 KB = 67 MB) and pool kv rows (34 MB)
are twice the L2, and its reductions leave the L2 (docs/performance/backward.md, "the L2 at
long contexts"). Each slot's terms depend only on its own row, lse and Delta, so a split by
rows changes no FLOP; it costs each token's q/dO load and dQ output once more a pass and up
to one more partial block a pass. This probe calls the shipped fast backward once a pass
(dQ and grad_kv summed outside: timing and a check, not a product) and reads the main
kernel's time from torch.profiler, so the Delta kernel and the epilogue each pass repeats do
not count.

Prediction: the blocks at 2-3 passes run at T = 4096's rate or near it (working sets of 50 / 34
MB), the tiles' fixed cost grows by about 10% a pass (a tile at K = 640: 5.8 of 55 units), and
with slots sorted by id in one pass nothing changes (no reuse: the pool rows of a round are
random). Net: the main kernel at T = 131072 10-25% faster with 2-3 passes, nothing at T = 4096.
"""
import json
import os

import torch
import triton

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import in_order, kernel_ms, pool_inputs, relerr

ROWS = [(4096, 64, 640, "causal"), (131072, 64, 640, "causal"), (32768, 64, 640, "distinct")]
ROWS = [ROWS[int(i)] for i in os.environ.get("PASS_ROWS", "0,1").split(",")]
PASSES = [int(p) for p in os.environ.get("PASS_COUNTS", "2,3,4").split(",")]


def compact(idx, keep):
    """idx with the slots where ``keep`` moved to the front in their order, -1 after them, and
    the count a token (int32)."""
    key = (~keep).to(torch.int8)
    order = torch.sort(key, dim=1, stable=True).indices
    ids = torch.where(keep, idx, torch.full_like(idx, -1)).gather(1, order)
    return ids.contiguous(), keep.sum(1).to(torch.int32)


def pass_ids(idx, T, N, P):
    """[(ids, lengths)] of P passes: the window rows (< T) and the first pool range, then the
    other pool ranges of [T, N)."""
    valid = (idx >= 0) & (idx < N)
    bounds = [T + (N - T) * r // P for r in range(P + 1)]
    out = []
    for r in range(P):
        keep = valid & (idx >= bounds[r]) & (idx < bounds[r + 1])
        if r == 0:
            keep |= valid & (idx < T)
        out.append(compact(idx, keep))
    return out


def timed(fn):
    ms = triton.testing.do_bench(fn, warmup=2, rep=300 if fn.slow else 200, return_mode="median")
    return round(ms, 3)


for T, H, K, ids in ROWS:
    D = 512
    q, kv, idx, sink, do, out, lse = pool_inputs(T, H, K, ids)
    N = kv.shape[0]

    def call(ids_, lengths=None, balanced=False):
        def run():
            # (without ``balanced`` the tokens keep their order, as without lengths: the
            # length-balanced order would scatter consecutive tokens and their shared window rows)
            saved = backward_gluon.balanced_order
            if not balanced:
                backward_gluon.balanced_order = in_order
            try:
                return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, ids_, sink, D ** -0.5,
                                           main=backward_gluon,
                                           deterministic=False, topk_length=lengths)
            finally:
                backward_gluon.balanced_order = saved
        run.slow = T > 32768
        return run

    arms = {"full": [call(idx)]}
    valid = (idx >= 0) & (idx < N)
    srt = torch.sort(torch.where(valid, idx, torch.full_like(idx, 2**30)), dim=1).values
    arms["sorted"] = [call(torch.where(srt < N, srt, -1).contiguous(), valid.sum(1).to(torch.int32))]
    for P in PASSES:
        arms[f"passes{P}"] = [call(i, n) for i, n in pass_ids(idx, T, N, P)]
    arms[f"passes{PASSES[0]}_balanced"] = [call(i, n, True) for i, n in pass_ids(idx, T, N, PASSES[0])]

    r = dict(T=T, H=H, K=K, D=D, ids=ids, N=N)
    S = min(T, 8192)  # (dQ checked over the first S tokens: four dQs of T = 131072 fill the GPU)
    g = arms["full"][0]()
    ref = (g[0][:S].float(), g[1].float())
    g = None
    for name, runs in arms.items():
        if name == "full":
            continue
        dq = dkv = 0
        for f in runs:
            g = f()
            dq, dkv, g = dq + g[0][:S].float(), dkv + g[1].float(), None
        r[f"{name}_err_dq"] = relerr(dq, ref[0])
        r[f"{name}_err_dkv"] = relerr(dkv, ref[1])
        dq = dkv = None
    ref = None
    fl = 10 * T * H * K * D
    names = list(arms)
    for rep in range(2):  # A, B, B, A
        for name in (names if rep % 2 == 0 else names[::-1]):
            ms = sum(timed(f) for f in arms[name])
            r[f"{name}_ms_{rep}"] = round(ms, 3)
    for name in names:
        parts = [kernel_ms(f) for f in arms[name]]
        r[f"{name}_main_ms"] = round(sum(m for m, _ in parts), 3)
        r[f"{name}_main_ms_passes"] = [m for m, _ in parts]
        r[f"{name}_main_tflops"] = round(fl / sum(m for m, _ in parts) * 1e-9, 1)
    print(json.dumps(r), flush=True)
    q = kv = idx = out = lse = do = srt = valid = None
    arms = None
    torch.cuda.empty_cache()
