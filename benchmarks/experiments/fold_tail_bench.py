"""The deterministic fold at D = 576 with one row a program: one 1024-column block (448
columns masked, the default) against a 512-column block and a 64-column tail side by side
(``backward.FOLD_TAIL``), in the whole deterministic backward (16-bit rows, the default at
576/512 under Triton 3.6), A, B, A, B in one process; each arm's fold time from the profiler.

    PYTHONPATH=src:tests:benchmarks/experiments python benchmarks/experiments/fold_tail_bench.py

Why: with 16-bit rows at 576/512 the fold read 1.9-2.0 TB/s against 2.6 at D = 512 (H100,
a6ce034): the masked block decodes fp16 on 1024 lanes for 576 columns. Prediction: the
fold at about 2.5 TB/s with the tail (H128 K1152 5.75 -> about 4.5 ms, H64 K640 1.54 ->
about 1.2 ms), the same bits.
"""
import json

import torch
import triton

from torch.profiler import ProfilerActivity, profile

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import pool_inputs


def fold_ms(run):
    """ms of the fold's launches in one profiled call."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return round(sum(e.device_time_total for e in prof.key_averages() if "dkv_reduce" in e.key) / 1e3, 3)


D, D_V = 576, 512
for T, H, K in ((4096, 64, 640), (4096, 128, 1152), (4096, 64, 2048)):
    q, kv, idx, sink, do, out, lse = pool_inputs(T, H, K, "distinct", D=D, d_v=D_V)

    def arm(tail):
        def run():
            saved, kbwd.FOLD_TAIL = kbwd.FOLD_TAIL, tail
            try:
                return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5,
                                           main=backward_gluon, deterministic=True)
            finally:
                kbwd.FOLD_TAIL = saved
        return run

    arms = {"masked": arm(False), "tail": arm(True)}
    r = dict(T=T, H=H, K=K, D=D)
    a, b = arms["masked"](), arms["tail"]()
    r["bitwise"] = all(torch.equal(x, y) for x, y in zip(a, b))
    a = b = None
    fl = 2 * T * H * K * (3 * D + 2 * D_V)
    for rep in range(2):
        for name in (("masked", "tail") if rep == 0 else ("tail", "masked")):
            ms = triton.testing.do_bench(arms[name], warmup=3, rep=100, return_mode="median")
            r[f"{name}_ms_{rep}"] = round(ms, 4)
            r[f"{name}_tflops_{rep}"] = round(fl / ms * 1e-9, 1)
    for name in arms:
        r[f"{name}_fold_ms"] = fold_ms(arms[name])
    print(json.dumps(r), flush=True)
    q = kv = idx = out = lse = do = None
    torch.cuda.empty_cache()
