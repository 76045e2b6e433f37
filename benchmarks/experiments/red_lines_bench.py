"""The fast backward's dKV reductions as half lines (``hopper.red_f32x4_fake``: a warp's
16-byte reduction instruction adds 8 rows x 64 bytes) against whole lines
(``hopper.red_f32x4_lines``: 4 rows x 128 bytes, quads exchanging halves with shuffles),
timed in one process next to the deterministic backward and cuDNN's.

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/red_lines_bench.py [PEER_DIR]

Inputs as in ``dkv_modes_bench.py`` (cuDNN's side-by-side ids: a window of 128, then
distinct pool rows). grad_kv of both variants is checked against the deterministic one.
"""
import json

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import bench, inputs, relerr  # (this directory)
from side_by_side import cudnn_peer as load_peer

dev = "cuda"
D = 512
cudnn_peer = load_peer()
shapes = [(4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (4096, 16, 1152), (4096, 32, 1152),
          (32768, 64, 640), (32768, 128, 1152)]
for T, H, K in shapes:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    scale = D ** -0.5
    fl = 10 * T * H * K * D
    r = dict(T=T, H=H, K=K)

    def run(det, lines=None):
        opts = {} if det else dict(lines=lines)
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                   deterministic=det, **opts)

    ref = run(True)
    r["det_ms"] = bench(lambda: run(True))
    for name, lines in (("half", False), ("lines", True)):
        got = run(False, lines)
        r[f"{name}_err_dkv"] = relerr(got[1].float(), ref[1].float())
        r[f"{name}_err_dq"] = relerr(got[0].float(), ref[0].float())
        r[f"{name}_ms"] = bench(lambda: run(False, lines))
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
    q = kv = idx = do = out = lse = ref = None
    torch.cuda.empty_cache()
