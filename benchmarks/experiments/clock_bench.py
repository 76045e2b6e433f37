"""The SMs' clock during the fast backward, and where its main kernel's time lies outside the
programs' tiles: the timeline's stamps (``launch(trace=...)``) taken once with the SM's
cycle counter and once with the GPU's global timer (``ablate`` 32: ns, one clock for every
SM), next to the main kernel's time from torch.profiler.

    clock_ghz      a tile's period (median, every tile but a program's first and last) in
                   cycles over the same in ns
    kernel_us      the traced main kernel's device time (profiler, mean of 5 calls)
    span_us        the first program's first stamp to the last program's last (global timer)
    outside_us     kernel_us - span_us: launch, the programs' set-up and exit
    start_us       each program's first stamp after the earliest one (quantiles 10/50/90, max)
    idle_end_us    each program's last stamp before the latest one (quantiles, mean): the SMs
                   idle at the end, e.g. the programs with one tile fewer in the last round
    tiles          the fewest and most tiles a program takes
    tile_busy_us   a tile's q/dO landing to both consumers' end (quantiles, every tile but a
                   program's first), and last_tiles_busy_us the same for the last tiles of the
                   eight programs that end last, which run while most SMs wait

    PYTHONPATH=src:benchmarks/experiments python benchmarks/experiments/clock_bench.py

Question (docs/performance/backward.md#where-the-backward-stands): do the SMs run at
1.98 GHz (nvidia-smi's reading) or about 1.75 (the cycle stamps' span against the calls'
time)? Prediction: the stamps' span is 0.88 of the kernel's time because part of it lies
outside the tiles: the last round (4,096 tiles on 132 SMs: 4 programs take a 32nd tile,
about 3% at H64 K640) and the set-up; the clock near 1.98 GHz.
"""
import json

import torch
from torch.profiler import ProfilerActivity, profile

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward_gluon as G
from side_by_side import inputs
from tile_timeline import EV, GHZ, quantiles, run, split

SHAPES = [(4096, 64, 640), (4096, 128, 1152), (4096, 128, 512)]
CALLS = 5


def main_kernel_us(fn) -> float:
    """The Gluon main kernel's device time a call (torch.profiler, CALLS calls)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()
               if "bwd_main_gluon" in e.key) / CALLS


def edges(tr: torch.Tensor, n_tiles: int) -> dict:
    """Programs' first and last stamps (ns) of a global-timer trace."""
    grid = tr.shape[0]
    counts = [len(range(p, n_tiles, grid)) for p in range(grid)]
    start = tr[:, 0, EV["p_tile"]].double()
    ends = [EV["c0_end"], EV["c1_end"]]
    last = torch.stack([tr[p, counts[p] - 1, ends].max() for p in range(grid)]).double()
    t0, t1 = start.min(), last.max()
    idle = (t1 - last) / 1e3
    # a tile's busy time, q/dO landed to both consumers done, against that of the tiles the
    # last programs run while most SMs wait (the kernel is bound by the L2, which they then
    # share with fewer SMs)
    qd = [EV["c0_qd"], EV["c1_qd"]]
    busy = torch.stack([tr[p, i, ends].max() - tr[p, i, qd].min()
                        for p in range(grid) for i in range(1, counts[p])])
    order = torch.argsort(last, descending=True)[:8].tolist()
    tail = [round(float(tr[p, counts[p] - 1, ends].max() - tr[p, counts[p] - 1, qd].min()) / 1e3, 1)
            for p in order]
    return {"tile_busy_us": quantiles((busy.double() / 1e3).tolist()), "last_tiles_busy_us": tail,
            "span_us": round(float(t1 - t0) / 1e3, 1),
            "start_us": quantiles(((start - t0) / 1e3).tolist()) + [round(float(start.max() - t0) / 1e3, 2)],
            "idle_end_us": quantiles(idle.tolist()) + [round(float(idle.mean()), 2)],
            "tiles": [min(counts), max(counts)]}


def main():
    for T, H, K in SHAPES:
        args = inputs(T, H, K, 512)
        n_tiles = T * -(-H // G.BLOCK_H)
        shape = G.trace_shape(T, H, args[0].device, False)
        blocks = -(-K // 64)
        row = dict(T=T, H=H, K=K, blocks=blocks, tiles_per_sm=round(n_tiles / shape[0], 2))
        for name, abl in (("clock64", 0), ("globaltimer", 32)):
            tr = torch.zeros(shape, dtype=torch.int64, device="cuda")
            row[f"kernel_us_{name}"] = round(main_kernel_us(lambda: run(args, trace=tr, ablate=abl)), 1)
            tr.zero_()
            run(args, trace=tr, ablate=abl)
            torch.cuda.synchronize()
            tr = tr.cpu()
            # split() reads stamps as cycles at GHZ: ns * GHZ reads back as microseconds
            parts = split(tr if abl == 0 else (tr.double() * GHZ).long(), n_tiles, blocks)
            row[f"period_{name}"] = parts["period"]
            if abl:
                row.update(edges(tr, n_tiles))
        row["kernel_us_plain"] = round(main_kernel_us(lambda: run(args)), 1)
        # cycles a period over ns a period (both medians, in units of 1,980 cycles and us)
        row["clock_ghz"] = round(GHZ * row["period_clock64"][1] / row["period_globaltimer"][1], 3)
        row["outside_us"] = round(row["kernel_us_globaltimer"] - row["span_us"], 1)
        print(json.dumps(row), flush=True)
        args = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
