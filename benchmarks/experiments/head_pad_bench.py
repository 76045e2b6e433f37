"""The Gluon backward at H <= 32 with its dKV products over 16 or 32 heads (the default,
``backward_gluon.HEAD_PAD``) against all 64 rows of the tile (``launch(head_pad=64)``), both
modes, A, B, A, B in one process, next to cuDNN's backward on the same tensors.

    PYTHONPATH=src:benchmarks/experiments python benchmarks/experiments/head_pad_bench.py [PEER_DIR]

Prediction (docs/performance/backward.md#small-head-counts): at H = 16 a block's tensor
work falls from 5 to 3.5 products of 64 x 64 x 512 (the two dKV products contract over 16
heads instead of 64), at H = 32 to 4; where a block is bound by its tensor work beside
its reductions (6.1 us a block at H16 K1152 against ~4.6 us of reductions at the L2's
rate), 5-12% less time at H = 16 and 3-8% at H = 32 in the fast mode; less in the
deterministic one (bound by its partial rows' HBM traffic). The ``fast_t`` arm: the fast
mode's small-head tiles transposed (``launch(transposed=True)``, the heads as the wgmma's N;
docs/performance/backward.md#small-head-tiles-transposed-kept), predicted 5-8% less than
HEAD_PAD alone at H = 16 and 3-4% at H = 32.
"""
import json
import sys

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import inputs, peer_bwd, time_arms
from side_by_side import cudnn_peer as load_peer

cudnn_peer = load_peer(sys.argv)
SHAPES = [(4096, 16, 1152), (4096, 32, 1152), (4096, 16, 160), (4096, 32, 640), (4096, 8, 1152),
          (32768, 16, 1152)]
for T, H, K in SHAPES:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K)
    scale = 512 ** -0.5
    r = dict(T=T, H=H, K=K, head_pad=backward_gluon._head_pad(H))

    def run(det, hp, tr=False):
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                   deterministic=det, head_pad=hp, transposed=tr)

    for det in (False, True):
        a, b = run(det, 64), run(det, None)
        r[f"{'det' if det else 'fast'}_rel_diff"] = [
            float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)) for x, y in zip(a, b)]
        if det:
            r["det_bitwise"] = all(torch.equal(x, y) for x, y in zip(a, b))
    a, b = run(False, None), run(False, None, True)
    r["fast_t_rel_diff"] = [
        float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)) for x, y in zip(a, b)]
    a = b = None
    fns = {"fast_64": lambda: run(False, 64), "fast": lambda: run(False, None),
           "fast_t": lambda: run(False, None, True),
           "det_64": lambda: run(True, 64), "det": lambda: run(True, None)}
    time_arms(r, fns, 10 * T * H * K * 512, peer_bwd(cudnn_peer, r, q, kv, idx, sink, scale, out, lse, do))
    r["fast_change"] = round(r["fast_ms"] / r["fast_64_ms"] - 1, 4)
    r["fast_t_change"] = round(r["fast_t_ms"] / r["fast_ms"] - 1, 4)
    r["det_change"] = round(r["det_ms"] / r["det_64_ms"] - 1, 4)
    if "cudnn_ms" in r:
        r["fast_vs_cudnn"] = round(r["cudnn_ms"] / r["fast_ms"], 3)
        r["fast_t_vs_cudnn"] = round(r["cudnn_ms"] / r["fast_t_ms"], 3)
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = fns = None
    torch.cuda.empty_cache()
