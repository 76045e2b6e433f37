"""The backward with q and dO loaded by TMA (``backward_gluon.launch(qd_tma=True)``) against
cp.async (the shipped producer), both modes, and in the fast mode with the first 2 or 3 D
quarters released early as well (``qd_early``), A, B, A, B in one process, next to cuDNN's.

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/qd_tma_bench.py [PEER_DIR]

Prediction (docs/performance/backward.md#q-and-do-by-tma): a tile's q and dO no longer
queue behind the last block's reductions in the SM's load/store path, so a tile's fixed
cost falls towards cuDNN's (17 -> 8-12 us at H = 128): 3-7% less time at H128 K1152 and
K512, 5-15% at K = 128-160, 2-5% at H64 K640 and at H = 16 and 32. Early release on top
(docs/performance/backward.md#q-and-do-released-a-quarter-at-a-time): about 1-2 us less a
tile, 1-2% at K >= 512 and 3-6% at K = 128-160.
Inputs as in ``split_roles_bench.py`` (cuDNN's side-by-side ids); the fast arm's grad_kv and
grad_q checked against the deterministic backward, the deterministic arm bitwise.
"""
import json

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import bench, inputs, relerr  # (this directory)
from side_by_side import cudnn_peer as load_peer

D = 512
cudnn_peer = load_peer()
shapes = [(4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (4096, 16, 1152), (4096, 32, 1152),
          (32768, 64, 640), (4096, 128, 128), (4096, 64, 160)]
for T, H, K in shapes:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    scale = D ** -0.5
    fl = 10 * T * H * K * D
    r = dict(T=T, H=H, K=K, tma_taken=bool(backward_gluon._tma_ok(q) and backward_gluon._tma_ok(do)))

    def run(det, tma, early=0):
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                   deterministic=det, qd_tma=tma, qd_early=early)

    arms = (("fast", False, False, 0), ("fast_tma", False, True, 0), ("fast_tma_early2", False, True, 2),
            ("fast_tma_early3", False, True, 3), ("det", True, False, 0), ("det_tma", True, True, 0))
    ref = run(True, False)
    got = run(True, True)
    r["det_tma_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(ref, got))
    got = run(False, True)
    r["fast_tma_err_dkv"] = relerr(got[1].float(), ref[1].float())
    r["fast_tma_err_dq"] = relerr(got[0].float(), ref[0].float())
    got = run(False, True, 3)
    r["fast_early3_err_dkv"] = relerr(got[1].float(), ref[1].float())
    for rep in range(2):  # A, B, A, B
        for name, det, tma, early in arms:
            r[f"{name}_ms_{rep}"] = bench(lambda: run(det, tma, early))
    for name, *_ in arms:
        r[f"{name}_ms"] = min(r.pop(f"{name}_ms_0"), r.pop(f"{name}_ms_1"))
    if cudnn_peer is not None:
        try:
            fc = cudnn_peer.make_bwd(q, kv, idx, sink, scale, out, lse, do)
            fc()
            r["cudnn_ms"] = bench(fc)
        except Exception as e:  # noqa: BLE001
            r["cudnn_error"] = str(e)[:200]
    for k in list(r):
        if k.endswith("_ms"):
            r[k.replace("_ms", "_tflops")] = round(fl / r[k] / 1e9, 1)
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = ref = got = None
    torch.cuda.empty_cache()
