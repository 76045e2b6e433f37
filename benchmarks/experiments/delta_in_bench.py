"""The backward with Delta formed by the main kernel's producer
(``sparse_mla_bwd(delta_in_kernel=True)``: O by TMA into the kv buffer once the last block
is done with it, summed against dO in shared memory before the first gather) against
Delta's own kernel, with q and dO by TMA in both (the path needs them so) and by cp.async
(the default at K > 256); the deterministic mode both ways; A, B, A, B in one process, next
to cuDNN's.

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/delta_in_bench.py [PEER_DIR]
    DELTA_WARM=arm ... : compile one arm on small cases and exit (fills the kernel cache)

Prediction (docs/performance/backward.md#delta-in-the-producer): Delta's kernel takes 254 us
(H = 128) and 130 us (H = 64) at T = 4096, about 4 us a tile; in the producer, O's load
leaves the critical path (it overlaps the last block's pieces and dQ's way out) and the sum
(128 KB of shared memory) delays the first gather by about 1 us: 2-4% less time in the fast
mode at K = 512-640, 1-2% at K = 1152, 5-10% at K = 128-160, under 1% at H = 16-32; the
deterministic mode the same microseconds less.
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
# name: (deterministic, options)
ARMS = {
    "fast": (False, {}),
    "fast_tma": (False, {"qd_tma": True}),
    "fast_delta": (False, {"delta_in_kernel": True}),
    "det": (True, {}),
    "det_delta": (True, {"delta_in_kernel": True}),
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
        for name in ("det_delta", "fast_delta"):
            got = run(args, *ARMS[name][:1], **ARMS[name][1])
            for i, g in enumerate(("dq", "dkv", "dsink")):
                r[f"{name}_err_{g}"] = relerr(got[i].float(), ref[i].float())
        again = (run(args, True, delta_in_kernel=True) for _ in range(2))
        r["det_delta_repeatable"] = all(torch.equal(a, b) for a, b in zip(*again))
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
    if os.environ.get("DELTA_WARM"):
        det, opts = ARMS[os.environ["DELTA_WARM"]]
        for k in (640, 128):  # (q and dO by TMA at K <= 256 by default)
            run(inputs(512, 64, k, D), det, **opts)
        torch.cuda.synchronize()
    else:
        main()
