"""The deterministic backward's timeline: every GPU kernel of one call in launch order, with
its start (us after the call's first kernel), its duration and the gap before it.

    python benchmarks/experiments/det_timeline.py [--T 4096] [--shapes 1,0] [--fast]

bench.py's inputs (D = 512, DeepSeek ids, seed 0). Per shape, one JSON line: the call's
median time (do_bench), the kernels' sum, the span from the first kernel's start to the
last one's end, and per kernel family (main, fold, sort, delta, epilogue, other) the summed
time; then the kernel list, one line each (``--list``). What it answers: how much of a
deterministic call is its chunks' main launches, their folds, the sorts and the gaps
between them.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from bench import SHAPES, backward_inputs, backward_mode, require_cuda

FAMILIES = (("main", ("bwd_main", "_bwd_kernel", "backward_gluon", "_bwd_gluon")),
            ("fold", ("fold", "reduce")),
            ("sort", ("sort", "Sort", "radix", "Radix", "search", "Search", "keys")),
            ("delta", ("delta",)),
            ("epilogue", ("epilogue",)))


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--shapes", default="1,0")
    ap.add_argument("--fast", action="store_true", help="the fast mode too")
    ap.add_argument("--list", action="store_true", help="every kernel, one line each")
    a = ap.parse_args()
    require_cuda("det_timeline.py")
    D = 512
    for i in a.shapes.split(","):
        H, K, label = SHAPES[int(i)]
        q, kv, idx, sink, out, lse, do, dl = backward_inputs(a.T, H, K, D)
        for det in ((True, False) if a.fast else (True,)):
            with backward_mode(det):
                run = lambda: torch.ops.dsv4.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, D ** -0.5)  # noqa
                run()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(run, warmup=50, rep=300)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    run()
                    torch.cuda.synchronize()
            evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0),
                         key=lambda e: e.time_range.start)
            t0 = evs[0].time_range.start
            fams, rows, prev_end, gaps = {}, [], t0, 0.0
            for e in evs:
                s, d = e.time_range.start - t0, e.time_range.end - e.time_range.start
                gap = max(0.0, e.time_range.start - prev_end)
                gaps += gap
                prev_end = max(prev_end, e.time_range.end)
                f = family(e.name)
                fams[f] = fams.get(f, 0.0) + d
                rows.append(dict(k=e.name[:60], fam=f, start_us=round(s, 1), us=round(d, 1),
                                 gap_us=round(gap, 1)))
            span = prev_end - t0
            print(json.dumps(dict(T=a.T, H=H, K=K, label=label, det=det, call_ms=round(ms, 4),
                                  span_ms=round(span / 1e3, 4), gaps_ms=round(gaps / 1e3, 4),
                                  n_kernels=len(rows),
                                  fam_ms={k: round(v / 1e3, 4) for k, v in sorted(fams.items())})),
                  flush=True)
            if a.list:
                for r in rows:
                    print(json.dumps(r))


if __name__ == "__main__":
    main()
