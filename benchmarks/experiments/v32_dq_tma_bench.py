"""The 576/512 layout's backward with the value columns of dQ staged in q's quarters and
stored by TMA (``backward_gluon.launch(dq_tma=1)``, ``DQ_TMA_ROPE``) against 64 stores a
thread (``dq_tma=0``), both modes, next to the D = 512 backward of the same shape (the
ratio of #16's third item), A, B, A, B in one process.

    PYTHONPATH=src python benchmarks/experiments/v32_dq_tma_bench.py
    V32_WARM=arm ...: compile one arm on a small case and exit (the arms in parallel processes)

Prediction (docs/performance/backward.md#the-576512-layout-in-the-gluon-main-kernel): at
D = 512, dQ by TMA gave 1-4% at K >= 512 in the unsplit schedule's era of the fast mode and
2-5% in the deterministic one; the 576/512 layout runs the unsplit schedule, so the same:
its fast backward from 0.81-0.85 of the D = 512 TFLOPS to 0.83-0.88, the deterministic one
from 0.81-0.86 to 0.83-0.89.
"""
import json
import os

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import best_of_ab, inputs, relerr

# name: (D, deterministic, dq_tma)
ARMS = {"fast_v32": (576, False, 0), "fast_v32_dqtma": (576, False, 1), "det_v32": (576, True, 0),
        "det_v32_dqtma": (576, True, 1), "fast_512": (512, False, None), "det_512": (512, True, None)}


def run(args, D, det, dq_tma):
    q, kv, idx, sink, do, out, lse = args
    return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5, main=backward_gluon,
                               deterministic=det, dq_tma=dq_tma)


def main(shapes):
    for T, H, K in shapes:
        args = {D: inputs(T, H, K, D, d_v=512) for D in (576, 512)}
        r = dict(T=T, H=H, K=K)
        ref = run(args[576], 576, True, 0)
        got = run(args[576], 576, True, 1)
        r["det_v32_dqtma_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(ref, got))
        got = run(args[576], 576, False, 1)
        r["fast_v32_dqtma_err_dq"] = relerr(got[0].float(), ref[0].float())
        r["fast_v32_dqtma_err_dkv"] = relerr(got[1].float(), ref[1].float())
        ref = got = None
        fns = {name: (lambda D=D, det=det, t=t: run(args[D], D, det, t))
               for name, (D, det, t) in ARMS.items()}
        for name, ms in best_of_ab(fns).items():
            D = ARMS[name][0]
            r[f"{name}_ms"] = ms
            r[f"{name}_tflops"] = round(2 * T * H * K * (3 * D + 2 * 512) / ms / 1e9, 1)
        for mode in ("fast", "det"):
            for arm in ("v32", "v32_dqtma"):
                r[f"{mode}_{arm}_ratio"] = round(r[f"{mode}_{arm}_tflops"] / r[f"{mode}_512_tflops"], 3)
        print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        args = fns = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if os.environ.get("V32_WARM"):
        D, det, t = ARMS[os.environ["V32_WARM"]]
        run(inputs(256, 64, 640, D, d_v=512), D, det, t)
        torch.cuda.synchronize()
    else:
        main([(4096, 64, 640), (4096, 128, 1152), (4096, 64, 2048)])
