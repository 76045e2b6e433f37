"""Where a tile's fixed cost goes: the fast backward with parts of a tile's work taken out
(``backward_gluon.launch(ablate=...)``; the gradients are wrong, the times are the point),
over a K sweep at H = 128 and 64, so that a least-squares fit of the time an SM spends on
a tile against the tile's 64-slot blocks splits each arm into a block's cost and a tile's
fixed cost. Every arm loads q and dO with cp.async (the default at K > 256) and stores dQ
from registers (``dq_tma=False``: the kernel as it was when this ran, at 1673433).

    ablate 0   the shipped kernel (split 2, cp.async)
           1   no dQ stores (the tile's epilogue)
           2   q and dO loaded for a program's first tile only (the boundary's 128 KB load)
           4   no lse / Delta loads at the tile's start
           8   every dKV reduction predicated off (the blocks' traffic)
           7   1 + 2 + 4

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/tile_ablation_bench.py [PEER_DIR]
    ABLATE_WARM=4 ... : compile one arm on a small case and exit (fills the kernel cache)

Prediction (docs/performance/backward.md#a-tiles-fixed-cost-taken-apart): the fixed cost
(13 us a tile against about 4 in cuDNN's main kernel) is mostly the boundary's waits: the
q/dO load behind the last block's reductions (arm 2: 2-4 us less a tile), the dQ stores
(arm 1: 1-2 us) and the lse/Delta loads behind them (arm 4: under 1 us); arm 8 removes
most of the per-block cost (530-576 TFLOPS measured with the reductions off) and, if the
LSU queue's drain is what the boundary waits for, much of the fixed cost too.
"""
import json
import os

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import best_of_ab, inputs
from side_by_side import cudnn_peer as load_peer

D = 512
ARMS = (0, 1, 2, 4, 8, 7)


def run(args, ablate):
    q, kv, idx, sink, do, out, lse = args
    return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5, main=backward_gluon,
                               deterministic=False, qd_tma=False, dq_tma=False, ablate=ablate)


if os.environ.get("ABLATE_WARM"):
    run(inputs(256, 64, 128, D), int(os.environ["ABLATE_WARM"]))
    torch.cuda.synchronize()
    raise SystemExit(0)

cudnn_peer = load_peer()
shapes = [(4096, 128, 128), (4096, 128, 512), (4096, 128, 1152), (4096, 64, 160), (4096, 64, 640)]
sms = torch.cuda.get_device_properties(0).multi_processor_count
for T, H, K in shapes:
    args = inputs(T, H, K, D)
    q, kv, idx, sink, do, out, lse = args
    r = dict(T=T, H=H, K=K, blocks=-(-K // 64), tiles_per_sm=T * (-(-H // 64)) / sms)
    fns = {f"abl{a}": (lambda a=a: run(args, a)) for a in ARMS}
    if cudnn_peer is not None:
        try:
            fns["cudnn"] = cudnn_peer.make_bwd(q, kv, idx, sink, D ** -0.5, out, lse, do)
        except Exception as e:  # noqa: BLE001
            r["cudnn_error"] = str(e)[:200]
    for fn in fns.values():
        fn()
    for name, ms in best_of_ab(fns).items():
        r[f"{name}_ms"] = ms
        r[f"{name}_us_tile"] = round(1e3 * ms / r["tiles_per_sm"], 2)
    print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    args = q = kv = idx = do = out = lse = fns = None
    torch.cuda.empty_cache()
