"""A tile's timeline in the Gluon main kernel of the fast backward: each program stamps the
SM's cycle counter at the events of ``backward_gluon.TRACE_EVENTS`` for every tile it takes
(``launch(trace=...)``), and this script splits a tile's period, from one tile's q/dO
landing to the next one's, into

    loop    the block loop, q/dO landed -> the last block's dKV pieces done (the later
            consumer)
    dq_out  -> both consumers' dQ halves out and q/dO released (staging, TMA store, its read)
    react   -> the producer past its wait for q/dO to be free (it issues the next tile's loads)
    load    -> the next tile's q and dO landed (as the first consumer to see them finds)

medians over every tile but each program's first and last, in units of 1,980 cycles
(microseconds at 1.98 GHz; the SMs run the fast backward at 1.77-1.80 GHz, so a unit is
1.10-1.12 us: clock_bench.py,
docs/performance/backward.md#the-clock-and-the-last-round-measured). ``per_block`` is the loop over the
tile's blocks. The traced and the plain call are timed in the same process; the
stamps are compiled out of the plain one (same PTX as without the option).

    PYTHONPATH=src:benchmarks/experiments python benchmarks/experiments/tile_timeline.py

Prediction (docs/performance/backward.md#a-tiles-timeline): of the 13 us a tile costs beyond
its blocks, the load and the dQ's way out take most; the producer reacts at once.
"""
import json
import os

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon as G
from side_by_side import bench, inputs

D = 512
GHZ = 1.98  # (the units printed: 1,980 cycles)
SHAPES = [(4096, 128, 1152), (4096, 64, 640), (4096, 128, 512), (4096, 128, 128), (4096, 64, 160)]
# (name, launch options): the default fast mode (q/dO by cp.async at K > 256, TMA below), and
# q/dO by TMA at every K
ARMS = [("fast", {}), ("fast_qd_tma", {"qd_tma": True})]
EV = {name: i for i, name in enumerate(G.TRACE_EVENTS)}


def run(args, trace=None, **opts):
    q, kv, idx, sink, do, out, lse = args
    return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5, main=G,
                               deterministic=False, trace=trace, **opts)


def quantiles(x):
    x = torch.tensor(x, dtype=torch.float64)
    q = torch.quantile(x, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    return [round(float(v), 2) for v in q]


def split(tr, n_tiles, blocks):
    """The period's parts (us), over every program's tiles after its first."""
    grid, per, _ = tr.shape
    us = tr.double() / (GHZ * 1e3)
    parts = {k: [] for k in ("loop", "dq_out", "react", "load", "period", "first_gather", "c_skew")}
    for p in range(grid):
        n = len(range(p, n_tiles, grid))
        e = us[p, :n]
        for i in range(1, n - 1):
            qd = torch.minimum(e[i, EV["c0_qd"]], e[i, EV["c1_qd"]])
            loop_end = torch.maximum(e[i, EV["c0_loop"]], e[i, EV["c1_loop"]])
            end = torch.maximum(e[i, EV["c0_end"]], e[i, EV["c1_end"]])
            nxt_qd = torch.minimum(e[i + 1, EV["c0_qd"]], e[i + 1, EV["c1_qd"]])
            parts["loop"].append(float(loop_end - qd))
            parts["dq_out"].append(float(end - loop_end))
            parts["react"].append(float(e[i + 1, EV["p_qd"]] - end))
            parts["load"].append(float(nxt_qd - e[i + 1, EV["p_qd"]]))
            parts["period"].append(float(nxt_qd - qd))
            parts["first_gather"].append(float(e[i, EV["p_first"]] - e[i, EV["p_qd"]]))
            parts["c_skew"].append(float(e[i, EV["c1_loop"]] - e[i, EV["c0_loop"]]))
    res = {k: quantiles(v) for k, v in parts.items() if v}
    res["per_block"] = round(res["loop"][1] / blocks, 2)
    return res


def warm(arm: str, traced: bool):
    """Compile one build on a small case (TIMELINE_WARM="arm,0|1": the builds compile in
    parallel processes before the timed run, which then finds them in the cache)."""
    args = inputs(512, 64, 640, D)
    tr = torch.zeros(G.trace_shape(512, 64, args[0].device, False), dtype=torch.int64, device="cuda")
    run(args, trace=tr if traced else None, **dict(ARMS)[arm])
    torch.cuda.synchronize()


def main():
    for T, H, K in SHAPES:
        args = inputs(T, H, K, D)
        n_tiles = T * -(-H // G.BLOCK_H)
        shape = G.trace_shape(T, H, args[0].device, False)
        for name, opts in ARMS:
            tr = torch.zeros(shape, dtype=torch.int64, device="cuda")
            run(args, **opts)
            run(args, trace=tr, **opts)
            torch.cuda.synchronize()
            row = dict(T=T, H=H, K=K, arm=name, blocks=-(-K // 64), tiles_per_sm=round(n_tiles / shape[0], 2),
                       ms=round(bench(lambda: run(args, **opts)), 4),
                       ms_traced=round(bench(lambda: run(args, trace=tr, **opts)), 4))
            tr.zero_()
            run(args, trace=tr, **opts)
            torch.cuda.synchronize()
            row.update(split(tr.cpu(), n_tiles, row["blocks"]))
            # the SM clock against the traced call's time: every program's first to last stamp
            span = (tr[:, :, EV["c0_end"]].max(1).values - tr[:, 0, EV["p_tile"]]).double().max()
            row["span_us_at_clock"] = round(float(span) / (GHZ * 1e3), 1)
            print(json.dumps(row), flush=True)
        args = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if os.environ.get("TIMELINE_WARM"):
        arm, traced = os.environ["TIMELINE_WARM"].split(",")
        warm(arm, traced == "1")
    else:
        main()
