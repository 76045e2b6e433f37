"""The fast backward with the tiles past the last whole round of programs cut into parts of
a few slot blocks, one a program (``backward_gluon.launch(split_remainder=True)``), against
whole tiles in the static round robin (docs/performance/backward.md#the-clock-and-the-last-round-measured).

    PYTHONPATH=src:benchmarks/experiments python benchmarks/experiments/remainder_bench.py

Checks first: grad_q (poisoned with NaN before the call) against the deterministic mode's,
which cuts nothing, and against the uncut fast mode's; grad_kv against the deterministic
mode's; grad_sink bitwise. Then A, B / B, A rounds in one process, and the programs' idle
time at the end from global-timer stamps (``ablate`` 16 + 32).

Prediction: the idle at the end from about a tile (65-90 us at H64 K640) to about a part
(1-2 slot blocks and a tile's fixed cost: 15-20 us): 2-2.5% less time at H64 K640, about
1% at H = 128 (T = 4096), 0.3% at T = 32768.
"""
import json
import os

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon as G
from side_by_side import bench, inputs, relerr
from tile_timeline import EV, quantiles


def run(args, det=False, grad_q=None, **opts):
    q, kv, idx, sink, do, out, lse = args
    return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, q.shape[-1] ** -0.5, main=G,
                               deterministic=det, grad_q=grad_q, **opts)


def check(T, H, K):
    args = inputs(T, H, K)
    nb = -(-K // 64)
    grid = G.program_count(T * -(-H // 64), args[0].device, False)
    n_full, n_parts = G._remainder_parts(T * -(-H // 64), grid, nb, True)
    det = run(args, det=True)
    whole = run(args, split_remainder=False)
    poisoned = torch.full_like(args[0], float("nan"))
    cut = run(args, grad_q=poisoned, split_remainder=True)
    row = dict(case="check", T=T, H=H, K=K, n_full=n_full, n_parts=n_parts,
               dq_nan=bool(cut[0].isnan().any()), dq_vs_det=relerr(cut[0], det[0]),
               dq_whole_vs_det=relerr(whole[0], det[0]),
               dq_rows_differ=int((cut[0] != whole[0]).any(-1).sum()),
               dkv_vs_det=relerr(cut[1], det[1]), dkv_whole_vs_det=relerr(whole[1], det[1]),
               dsink_bitwise=bool(torch.equal(cut[2], whole[2])))
    print(json.dumps(row), flush=True)


def idle(args, T, H, cut):
    shape = G.trace_shape(T, H, args[0].device, False)
    tr = torch.zeros(shape, dtype=torch.int64, device="cuda")
    run(args, trace=tr, ablate=32, split_remainder=cut)
    torch.cuda.synchronize()
    tr = tr.cpu().double()
    counts = (tr[:, :, EV["p_tile"]] > 0).sum(1)
    ends = [EV["c0_end"], EV["c1_end"]]
    last = torch.stack([tr[p, int(counts[p]) - 1, ends].max() for p in range(shape[0])])
    gap = ((last.max() - last) / 1e3).tolist()
    return quantiles(gap) + [round(sum(gap) / len(gap), 1)]


def timing(T, H, K, rounds):
    args = inputs(T, H, K)
    row = dict(case="time", T=T, H=H, K=K)
    arms = [("whole", {"split_remainder": False}), ("cut", {"split_remainder": True})]
    for r in range(rounds):  # (A, B, then B, A)
        for name, opts in arms if r % 2 == 0 else arms[::-1]:
            row.setdefault(name, []).append(round(bench(lambda: run(args, **opts)), 4))
    for name in ("whole", "cut"):
        v = sorted(row[name])
        row[f"{name}_min_median"] = [v[0], round((v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2, 4)]
        row[f"idle_{name}"] = idle(args, T, H, name == "cut")
    print(json.dumps(row), flush=True)


def main():
    rounds = int(os.environ.get("REMAINDER_ROUNDS", "6"))
    for T, H, K in ((300, 64, 300), (200, 128, 1152), (4096, 64, 640), (4096, 128, 1152), (1000, 64, 96)):
        check(T, H, K)
    for T, H, K in ((4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (32768, 64, 640)):
        timing(T, H, K, rounds)


if __name__ == "__main__":
    main()
