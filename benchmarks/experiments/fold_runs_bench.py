"""The deterministic fold cut by entries (``backward.FOLD_RUNS``: ``_dkv_fold_runs_kernel``,
runs of a chunk's sorted entries, one a program) against the fold by kv rows
(``_dkv_reduce_kernel`` with ``fold_tile``), in the whole deterministic backward, timed
A, B, ... then reversed, in one process.

    PYTHONPATH=src:tests:benchmarks:benchmarks/experiments \
        python benchmarks/experiments/fold_runs_bench.py

At T = 131072 the fold by rows reads the chunks' partial rows at about 2.3 TB/s (74 ms of
a 159 ms call at H64 K640, bench.py's ids; 3.8 TB/s at T = 4096): each chunk schedules a
program for every four of the N = 163,840 rows, most without entries, and a row's few
entries are a chain of dependent loads.

Prediction: at T = 131072 the fold 25-35% shorter (toward 3.5 TB/s), the deterministic
call 10-15% (H64 K640) and 5-10% (H128 K1152) shorter; at T = 4096 and 32768 (rows with
tens to hundreds of entries) within a few percent either way. Every arm bitwise the same.
"""
import json
import os

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon as G
from ncu_peer import causal_inputs
from side_by_side import bench, inputs

ROWS = [(4096, 64, 640, "distinct"), (4096, 128, 1152, "distinct"), (32768, 64, 640, "distinct"),
        (131072, 64, 640, "causal"), (131072, 128, 1152, "causal")]
# RUNS_ROWS="3,4": rows of ROWS; RUNS_CONFIGS="4,4,8,1 4,4,16,0": FOLD_RUNS_CONFIGs to time
# (entries a step, warps, programs an SM, accumulator rows preloaded)
ROWS = [ROWS[int(i)] for i in os.environ.get("RUNS_ROWS", "0,1,2,3,4").split(",")]
# RUNS_D=576: the 576/512 layout (q and kv 576 wide, values the first 512 columns), whose
# fold rows are 1024-column programs with 448 columns masked
D = int(os.environ.get("RUNS_D", "512"))
CONFIGS = [tuple(int(v) for v in c.split(",")) for c in os.environ.get(
    "RUNS_CONFIGS", "8,4,8,1 8,4,4,1 4,4,8,1").split()]
ARMS = [("rows", False, None)]
ARMS += [("runs_" + "_".join(map(str, c)), True, c[:3] + (bool(c[3]),)) for c in CONFIGS]


def run(args, runs, config):
    kbwd.FOLD_RUNS = runs
    if config is not None:
        kbwd.FOLD_RUNS_CONFIG = config
    q, kv, idx, sink, do, out, lse = args
    return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, q.shape[-1] ** -0.5, main=G,
                               deterministic=True)


def one(T, H, K, ids, reps):
    d_v = None if D == 512 else 512
    args = inputs(T, H, K, D, d_v=d_v) if ids == "distinct" else causal_inputs(T, H, K, D, d_v)
    row = dict(T=T, H=H, K=K, D=D, ids=ids)
    ref = run(args, False, None)
    for name, runs, config in ARMS[1:]:
        got = run(args, runs, config)
        row[f"{name}_bitwise"] = all(torch.equal(a, b) for a, b in zip(ref, got))
        del got
    del ref
    for r in range(reps):
        for name, runs, config in ARMS if r % 2 == 0 else ARMS[::-1]:
            row.setdefault(name, []).append(round(bench(lambda: run(args, runs, config)), 4))
    for name, _, _ in ARMS:
        row[f"{name}_best"] = min(row[name])
    print(json.dumps(row), flush=True)


def main():
    reps = int(os.environ.get("RUNS_REPS", "2"))
    for T, H, K, ids in ROWS:
        one(T, H, K, ids, reps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
