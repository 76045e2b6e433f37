"""The backward with Delta formed in the main kernel (``backward_gluon.FUSED_DELTA``:
``sparse_mla_bwd(..., fused_delta=True)``) against the separate Delta kernel, both modes, A,
B, A, B in one process, next to cuDNN's.

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/fused_delta_bench.py [PEER_DIR]

Prediction (docs/performance/backward.md#delta-in-the-main-kernel): the Delta kernel reads O
and dO whole before the main kernel starts (about 130 us at H64, 254 at H128, T = 4096, at
4.1 TB/s); in the main kernel each consumer reads the tile's O rows (64 KB, the second read
from the L2) and dO from shared memory at the tile's start, about 1 us of a tile's 30-130.
So the fast mode 2-5% less time at K >= 512 (H128 K512 the most: 3.7 ms, 0.25 of Delta),
7-15% at K = 128-160, the deterministic one about half that share; T = 32768 as T = 4096.
"""
import json

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import best_of_ab, inputs, relerr
from side_by_side import cudnn_peer as load_peer

D = 512
cudnn_peer = load_peer()
# (the shapes where the prediction differs most first: a run cut short still answers it)
shapes = [(4096, 64, 640), (4096, 128, 512), (4096, 128, 128), (4096, 128, 1152), (4096, 64, 160),
          (4096, 32, 1152), (4096, 16, 1152), (32768, 64, 640)]
for T, H, K in shapes:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    dlse = torch.randn_like(lse) * 0.1
    scale = D ** -0.5
    fl = 10 * T * H * K * D
    r = dict(T=T, H=H, K=K)

    def run(det, fused, grad_lse=None):  # timed without grad_lse, as cuDNN's and the sweep's calls
        return kbwd.sparse_mla_bwd(do, grad_lse, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                   deterministic=det, fused_delta=fused)

    ref = run(True, False, dlse)
    got = run(True, True, dlse)
    again = run(True, True, dlse)
    r["det_fused_bitwise_repeat"] = all(torch.equal(a, b) for a, b in zip(got, again))
    for i, name in enumerate(("dq", "dkv", "dsink")):
        r[f"det_fused_err_{name}"] = relerr(got[i].float(), ref[i].float())
    got = run(False, True, dlse)
    r["fast_fused_err_dq"] = relerr(got[0].float(), ref[0].float())
    r["fast_fused_err_dkv"] = relerr(got[1].float(), ref[1].float())
    ref = got = again = None
    fns = {"fast": lambda: run(False, False), "fast_fused": lambda: run(False, True),
           "det": lambda: run(True, False), "det_fused": lambda: run(True, True)}
    if cudnn_peer is not None:
        try:
            fns["cudnn"] = cudnn_peer.make_bwd(q, kv, idx, sink, scale, out, lse, do)
            fns["cudnn"]()
        except Exception as e:  # noqa: BLE001
            r["cudnn_error"] = str(e)[:200]
            fns.pop("cudnn", None)
    for name, ms in best_of_ab(fns).items():
        r[f"{name}_ms"] = ms
        r[f"{name}_tflops"] = round(fl / ms / 1e9, 1)
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = dlse = fns = None
    torch.cuda.empty_cache()
