"""How much of a backward call's measured time is the GPU waiting for the host? The backward
sweep times ``torch.ops.dsv4.sparse_mla_bwd`` with ``triton.testing.do_bench``, which
flushes the L2 before each call: every call starts on an idle GPU, so the host's time before
each launch inside the call (the op's dispatch, the Triton launches, the TMA descriptors)
counts wherever it is longer than the GPU work queued ahead of it. The same call replayed
from a CUDA graph has no host time inside it.

    PYTHONPATH=src:benchmarks:benchmarks/experiments python benchmarks/experiments/host_gap_bench.py

Prints, per shape and mode: the op eager (as the sweep times it), the op replayed from a CUDA
graph (both do_bench medians, L2 flushed), and the call's host time (median of the calls'
own wall time, which returns once the work is queued). Prediction: the eager call takes the
graph's time plus the part of the host time that runs before the main kernel's launch
beyond the Delta kernel's GPU time: 0.05-0.2 ms at T = 4096 (2-8% of H64 K640's fast call),
less at H = 128.
"""
import json
import os
import statistics
import time

import torch
import triton

import dsv4_sparse_attn
from bench import make_inputs
from side_by_side import graphed

dev = "cuda"
ROWS = [(4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (4096, 16, 1152), (4096, 64, 160)]
ROWS = [ROWS[int(i)] for i in os.environ.get("GAP_ROWS", "0,1,2,3,4").split(",")]


def host_us(fn, n=30):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def timed(fn, add):
    """``fn`` wrapped: each call's wall time in seconds goes to ``add(args, seconds)``."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            add(args, time.perf_counter() - t0)
    return wrapper


def steady_us(fn, n=30):
    """Host time a call with ``n`` calls queued back to back (the GPU behind, as in
    training: the host's own rate, not its time to wake on an idle GPU)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) * 1e6 / n
    torch.cuda.synchronize()
    return round(t, 1)


def case(T, H, K, D=512):
    """The host-time scripts' call: (q, kv, idx, sink, scale, out, lse, do) with distinct
    pool ids, out and lse from the forward."""
    q, kv, idx, sink = make_inputs(T, H, K, D, pool="distinct", n_pool=max(T // 4, K))
    scale = D ** -0.5
    out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, scale)
    return q, kv, idx, sink, scale, out, lse, torch.randn_like(out)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def main():
    from triton.testing import do_bench
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    for T, H, K in ROWS:
        D = 512
        q, kv, idx, sink, scale, out, lse, do = case(T, H, K, D)
        bwd = lambda: torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale)  # noqa: E731
        row = dict(T=T, H=H, K=K)
        for mode, det in (("fast", False), ("det", True)):
            dsv4_sparse_attn.set_deterministic_backward(det)
            try:
                bwd()
                eager = do_bench(bwd, warmup=25, rep=100, return_mode="median")
                host = host_us(bwd)
                g, _ = graphed(bwd)
                graph = do_bench(g.replay, warmup=25, rep=100, return_mode="median")
                eager2 = do_bench(bwd, warmup=25, rep=100, return_mode="median")
                del g
            finally:
                dsv4_sparse_attn.set_deterministic_backward(None)
            row[mode] = dict(eager_ms=round(min(eager, eager2), 4), graph_ms=round(graph, 4),
                             host_us=round(host, 1), eager_over_graph=round(min(eager, eager2) / graph, 3))
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
