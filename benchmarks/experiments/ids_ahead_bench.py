"""The fast backward with the next tile's first block's ids loaded ahead, with the last
block's gather (``backward_gluon.launch(ids_ahead=True)``), against the default producer,
with q and dO by cp.async (the default at K > 256) and by TMA; the deterministic mode with
both producers (bitwise equal); A, B, A, B in one process, next to cuDNN's.

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/ids_ahead_bench.py [PEER_DIR]
    IDS_WARM=arm ... : compile one arm on a small case and exit (fills the kernel cache)

Prediction (docs/performance/backward.md#a-tiles-timeline): a tile's first gather is issued
1.8 us (TMA) to 3.0 us (cp.async) after q and dO, behind a global load of the ids, and
lands after q and dO; with the ids ahead it goes out about 0.5-1 us earlier: 1-1.5% less
time at K = 512-640, under 1% at K = 1152, 3-5% at K = 128-160, with q/dO by TMA. With
cp.async q/dO the producer spills 200 more bytes (its 64 q/dO pointers and the carried
ids), which may eat the gain.
"""
import json
import os

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import best_of_ab, inputs, relerr
from side_by_side import cudnn_peer as load_peer

D = 512
# name: (deterministic, launch options)
ARMS = {
    "fast": (False, {}),
    "fast_ids": (False, {"ids_ahead": True}),
    "fast_tma": (False, {"qd_tma": True}),
    "fast_tma_ids": (False, {"qd_tma": True, "ids_ahead": True}),
    "det": (True, {}),
    "det_ids": (True, {"ids_ahead": True}),
}


def run(args, det, **opts):
    q, kv, idx, sink, do, out, lse = args
    return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5, main=backward_gluon,
                               deterministic=det, **opts)


def main():
    cudnn_peer = load_peer()
    shapes = [(4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (4096, 16, 1152), (4096, 32, 1152),
              (32768, 64, 640), (4096, 128, 128), (4096, 64, 160)]
    for T, H, K in shapes:
        args = inputs(T, H, K, D)
        q, kv, idx, sink, do, out, lse = args
        fl = 10 * T * H * K * D
        r = dict(T=T, H=H, K=K)
        ref = run(args, True)
        got = run(args, True, ids_ahead=True)
        r["det_ids_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(ref, got))
        for name in ("fast_ids", "fast_tma_ids"):
            got = run(args, False, **ARMS[name][1])
            r[f"{name}_err_dq"] = relerr(got[0].float(), ref[0].float())
            r[f"{name}_err_dkv"] = relerr(got[1].float(), ref[1].float())
        ref = got = None
        fns = {name: (lambda det=det, opts=opts: run(args, det, **opts))
               for name, (det, opts) in ARMS.items()}
        if cudnn_peer is not None:
            try:
                fns["cudnn"] = cudnn_peer.make_bwd(q, kv, idx, sink, D ** -0.5, out, lse, do)
                fns["cudnn"]()
            except Exception as e:  # noqa: BLE001
                r["cudnn_error"] = str(e)[:200]
                fns.pop("cudnn", None)
        for name, ms in best_of_ab(fns).items():
            r[f"{name}_ms"] = ms
            r[f"{name}_tflops"] = round(fl / ms / 1e9, 1)
        print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        args = q = kv = idx = do = out = lse = fns = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if os.environ.get("IDS_WARM"):
        det, opts = ARMS[os.environ["IDS_WARM"]]
        for k in (640, 128):  # (q and dO by TMA at K <= 256 by default)
            run(inputs(512, 64, k, D), det, **opts)
        torch.cuda.synchronize()
    else:
        main()
