"""Where the host's time goes in one deterministic backward call of many chunks (H64
K2048, T = 4096: 32 chunks of 132 tokens), with and without per-token lengths: the host's
time to enqueue a call (ten calls back to back, the GPU idle before them), the kernels'
GPU time (torch.profiler), and cProfile's top functions over ten calls.

    PYTHONPATH=src:benchmarks python benchmarks/experiments/host_profile_bench.py
"""
import cProfile
import io
import json
import pstats
import time

import torch

import features_bench as F
from chunk_order_bench import host_ms, kernel_ms

T, H, K, D = 4096, 64, 2048, 512
q, kv, idx, sink = F.inputs(T, H, K, D)
g = torch.Generator(device="cuda").manual_seed(1)
length = torch.randint(128, K + 1, (T,), device="cuda", generator=g, dtype=torch.int32)
out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None, length)
do, dl = torch.randn_like(out), torch.randn_like(lse)

for arm, lengths in (("lengths", length), ("full", None)):
    def bwd():
        return torch.ops.dsv4.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, None, lengths)
    with F.backward_mode(True):
        row = dict(arm=arm, wall_ms=F.bench(bwd, 25, 200), kernels_ms=kernel_ms(bwd), host_ms=host_ms(bwd))
        bwd()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        for _ in range(10):
            bwd()
        prof.disable()
        row["host_ms_profiled"] = (time.perf_counter() - t) * 100
        torch.cuda.synchronize()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(22)
    st.sort_stats("cumulative").print_stats(30)
    print(s.getvalue())
