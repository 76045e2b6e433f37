"""The deterministic backward with its partial rows in 16 bits (fp16, a power-of-two scale a
64-column segment; the prototype ``sparse_mla_bwd(partial16=True)``, Triton and Gluon main kernels)
against fp32 rows, A, B, B, A in one process, with each arm's time split between the main
kernel and the fold (torch.profiler), next to the Gluon deterministic and fast modes.

    PYTHONPATH=src:tests:benchmarks/experiments python benchmarks/experiments/partial16_bench.py

Why: the deterministic mode's cost beyond the fast mode is its partial rows' bytes; 16-bit
rows halve them and err 8x below grad_kv's bf16 rounding
(docs/performance/backward.md#partial-rows-in-16-bits).
Measured first (203e5df, H100): the fold 1.8x slower with 16-bit rows (a scale byte loaded
with each value). Prediction with one scale word an entry and part: the fold's time about
halves (it reads at a fixed TB/s: H64 K640 about 1.4 -> 0.75 ms on the H200); the Triton
main kernel's stores at half the bytes take a few percent off it or nothing (its fp16
conversion and the segments' maxima cost instructions).
"""
import json
import os

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon, backward_triton
from side_by_side import pool_inputs, relerr

# P16_D=576: the 576/512 layout (q.k over 576 columns, values the first 512; 16-bit rows
# there have the score-only columns as two 32-column segments, one a Gluon consumer)
D = int(os.environ.get("P16_D", "512"))
D_V = 512 if D == 576 else None
ROWS = [(4096, 64, 640, "distinct"), (4096, 128, 1152, "distinct"), (32768, 64, 640, "distinct"),
        (4096, 16, 1152, "distinct"), (4096, 32, 1152, "distinct"), (131072, 64, 640, "causal"),
        (4096, 64, 640, "causal"), (4096, 64, 2048, "distinct")]
# P16_ROWS="0,1": rows of ROWS (default 0, 1, 3, 4); P16_REPS: A, B passes (default 2);
# P16_ARMS: the arms timed (default all)
ROWS = [ROWS[int(i)] for i in os.environ.get("P16_ROWS", "0,1,3,4").split(",")]
REPS = int(os.environ.get("P16_REPS", "2"))


def runs_fold(run):
    """``run`` with the fold cut by entry runs (``backward.FOLD_RUNS``)."""
    def forced():
        saved, kbwd.FOLD_RUNS = kbwd.FOLD_RUNS, True
        try:
            return run()
        finally:
            kbwd.FOLD_RUNS = saved
    return forced


def split(run):
    """ms of the main kernel, the fold and the rest, from one profiled call."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    parts = dict(main=0.0, fold=0.0, other=0.0)
    for e in prof.key_averages():
        t = e.device_time_total / 1e3
        key = "main" if "bwd_main" in e.key else "fold" if ("dkv_reduce" in e.key or "fold_runs" in e.key) \
            else "other"
        parts[key] += t
    return {k: round(v, 3) for k, v in parts.items()}


for T, H, K, ids in ROWS:
    q, kv, idx, sink, do, out, lse = pool_inputs(T, H, K, ids, D=D, d_v=D_V)
    arms = {
        "triton_fp32": lambda: kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5,
                                                   main=backward_triton, deterministic=True, partial16=False),
        "triton_16": lambda: kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5,
                                                 main=backward_triton, deterministic=True, partial16=True),
        "gluon_16": lambda: kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5,
                                                main=backward_gluon, deterministic=True, partial16=True),
        "gluon_det": lambda: kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5,
                                                 main=backward_gluon, deterministic=True, partial16=False),
        "gluon_fast": lambda: kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5,
                                                  main=backward_gluon, deterministic=False),
    }
    # the fold cut by entry runs (the long contexts' fold) at these rows too
    arms["triton_fp32_runs"] = runs_fold(arms["triton_fp32"])
    arms["triton_16_runs"] = runs_fold(arms["triton_16"])
    if "P16_ARMS" in os.environ:
        arms = {k: v for k, v in arms.items() if k in os.environ["P16_ARMS"].split(",")}
    r = dict(T=T, H=H, K=K, D=D, ids=ids)
    for fp32, b16 in (("triton_fp32", "triton_16"), ("gluon_det", "gluon_16")):
        if fp32 in arms and b16 in arms:
            ref, got = arms[fp32](), arms[b16]()
            r[f"{b16}_err_dkv_vs_fp32"] = relerr(got[1].float(), ref[1].float())
            r[f"{b16}_dq_dsink_equal"] = bool(torch.equal(got[0], ref[0]) and torch.equal(got[2], ref[2]))
            r[f"{b16}_bitwise_rerun"] = all(torch.equal(x, y) for x, y in zip(got, arms[b16]()))
            ref = got = None
    fl = 2 * T * H * K * (3 * D + 2 * (D_V or D))  # (10 T H K D at D = d_v)
    names = list(arms)
    for rep in range(REPS):
        for name in (names if rep % 2 == 0 else names[::-1]):
            ms = triton.testing.do_bench(arms[name], warmup=3, rep=100, return_mode="median")
            r[f"{name}_ms_{rep}"] = round(ms, 4)
            r[f"{name}_tflops_{rep}"] = round(fl / ms * 1e-9, 1)
    for name in [n for n in ("triton_fp32", "triton_16", "triton_fp32_runs", "triton_16_runs", "gluon_det",
                             "gluon_16") if n in arms]:
        r[f"{name}_split"] = split(arms[name])
    print(json.dumps(r), flush=True)
    q = kv = idx = out = lse = do = None
    torch.cuda.empty_cache()
