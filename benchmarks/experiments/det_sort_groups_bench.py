"""The deterministic backward with its chunks' ids inverted one chunk a sort
(``SORT_ENTRIES = 1``) against several chunks a sort (the default), timed A, B, A, B in
one process, with and without per-token lengths; also the host time of a call (from the
call to its return, before the GPU finishes) and the kernels' sum.

    PYTHONPATH=src:tests:benchmarks python benchmarks/experiments/det_sort_groups_bench.py > det_sort.jsonl

Prediction (docs/performance/backward.md#sorts-for-several-chunks): with lengths uniform in
[128, K] the deterministic call is host-bound at K = 2048 (19 chunks; 12.1 ms where its
kernels should take about 9), and one sort for four chunks takes it to its kernels' time:
lengths/full 0.84 -> about 0.65; full-K calls within 2% (their kernels outlast the host).
Inputs as in ``features_bench.py`` (T = 4096, bf16, a sink, DeepSeek ids, seed 0).
"""
import json
import sys
import time

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from features_bench import inputs

SHAPES = [(4096, 64, 640), (4096, 128, 1152), (4096, 64, 2048)]
ARMS = {"sort-per-chunk": 1, "sort-groups": kbwd.SORT_ENTRIES}


def events_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort(), host.sort()
    return times[len(times) // 2], host[len(host) // 2]


for T, H, K in SHAPES:
    q, kv, idx, sink = inputs(T, H, K, 512)
    g = torch.Generator(device="cuda").manual_seed(1)
    lengths = torch.randint(128, K + 1, (T,), device="cuda", generator=g, dtype=torch.int32)
    for length in (None, lengths):
        out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None, length)
        do = torch.randn_like(out)
        dsv4_sparse_attn.set_deterministic_backward(True)

        def call():
            return torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, None, length)

        grads = {}
        for rep in range(2):
            for arm, entries in ARMS.items():
                kbwd.SORT_ENTRIES = entries
                ms, host_ms = events_ms(call)
                if arm not in grads:
                    grads[arm] = call()
                print(json.dumps(dict(T=T, H=H, K=K, lengths=length is not None, arm=arm, rep=rep,
                                      ms=round(ms, 4), host_ms=round(host_ms, 4))), flush=True)
        kbwd.SORT_ENTRIES = ARMS["sort-groups"]
        same = all(torch.equal(a, b) for a, b in zip(grads["sort-per-chunk"], grads["sort-groups"]))
        print(json.dumps(dict(T=T, H=H, K=K, lengths=length is not None, bitwise_equal=same)), flush=True)
        if not same:
            sys.exit("the arms' gradients differ")
