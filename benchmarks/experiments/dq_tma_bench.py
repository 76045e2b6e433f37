"""The backward with dQ staged in the tile's q quarters and stored by TMA
(``backward_gluon.launch(dq_tma=1)``) against the plain stores (``dq_tma=0``: 64
four-byte stores a thread from the wgmma layout), both modes, A, B, A, B in one process,
next to cuDNN's. (Run first at c631e59.)

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/dq_tma_bench.py [PEER_DIR]

Prediction (docs/performance/backward.md#a-tiles-fixed-cost-taken-apart): without its dQ
stores the fast backward's tile takes 5-11 us less (tile_ablation_bench.py: H128 K1152 126
-> 115 us, H64 K640 77 -> 70); staged and stored by TMA they leave the SM's load/store
path, at the price of the next tile's q/dO load waiting for the staging (about 1 us): 5-8%
less time in the fast mode at K >= 512 (H128 K1152 7.8 -> 7.2-7.4 ms, 1.03-1.06x cuDNN),
more at K = 128-160; the deterministic mode (its partial-row stores in the same path) 2-5%
less, bitwise equal. Two more arms staged dQ in the kv block's buffer (2: at the tile's
end, 3: right after each consumer's dQ of the last block), so that the next tile's q/dO
load would not wait for the staging: level with arm 1 at 0ad96c2, 9-16% slower than it at
K >= 512 at 1e88615 (after the staging barrier's phase fix), and removed
(docs/performance/backward.md#dq-by-tma).
"""
import json

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import inputs, peer_bwd, time_arms, relerr
from side_by_side import cudnn_peer as load_peer

D = 512
cudnn_peer = load_peer()
shapes = [(4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (4096, 16, 1152), (4096, 32, 1152),
          (32768, 64, 640), (4096, 128, 128), (4096, 64, 160)]
for T, H, K in shapes:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    scale = D ** -0.5
    fl = 10 * T * H * K * D
    r = dict(T=T, H=H, K=K)

    def run(det, dq_tma, **kw):
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                   deterministic=det, dq_tma=dq_tma, **kw)

    arms = [("fast", False, 0, {}), ("fast_dqtma", False, 1, {}), ("det", True, 0, {}),
            ("det_dqtma", True, 1, {})]
    ref = run(True, 0)
    for name, mode in (("dqtma", 1),):
        got = run(True, mode)
        r[f"det_{name}_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(ref, got))
        got = run(False, mode)
        r[f"fast_{name}_err_dq"] = relerr(got[0].float(), ref[0].float())
        r[f"fast_{name}_err_dkv"] = relerr(got[1].float(), ref[1].float())
    ref = got = None
    fns = {name: (lambda det=det, t=t, kw=kw: run(det, t, **kw)) for name, det, t, kw in arms}
    time_arms(r, fns, fl, peer_bwd(cudnn_peer, r, q, kv, idx, sink, scale, out, lse, do))
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = fns = None
    torch.cuda.empty_cache()
