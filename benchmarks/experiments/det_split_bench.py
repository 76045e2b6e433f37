"""The deterministic backward at one head block (H <= 64) with the blocks' roles split in
time (``launch(split=1)``: P and dS single-buffered) against the unsplit schedule it runs
by default, A, B, A, B in one process, with and without per-token lengths, next to the
fast mode and cuDNN's backward.

    PYTHONPATH=src:benchmarks/experiments python benchmarks/experiments/det_split_bench.py [PEER_DIR]
    DET_SPLIT_IDS=bench ...: bench.py's default-table inputs instead (uniform pool ids, grad_lse),
    the shapes of that table at one head block, unsplit / split 1 only

Prediction (docs/performance/backward.md#split-roles, two earlier runs: 1.8-3.1% less at
H64 K640, H16 and H32 K1152, 0.4% at T = 32768): 1-3% less time at K >= 640, unknown at
K = 160 and with lengths; gradients bitwise equal to the unsplit schedule's.
"""
import json
import os
import sys

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import inputs, peer_bwd, time_arms
from side_by_side import cudnn_peer as load_peer

cudnn_peer = load_peer()
BENCH_IDS = os.environ.get("DET_SPLIT_IDS") == "bench"
if BENCH_IDS:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import bench
# (T, H, K, lengths)
SHAPES = [(4096, 64, 640, False), (4096, 64, 640, True), (4096, 64, 160, False), (4096, 16, 1152, False),
          (4096, 32, 1152, False), (4096, 64, 2048, False), (4096, 16, 160, False), (4096, 32, 1152, True),
          (32768, 64, 640, False)]
if BENCH_IDS:
    SHAPES = [(4096, 64, 640, False), (4096, 16, 1152, False), (4096, 32, 1152, False),
              (4096, 64, 2048, False)]
for T, H, K, with_len in SHAPES:
    dl = None
    if BENCH_IDS:
        q, kv, idx, sink, out, lse, do, dl = bench.backward_inputs(T, H, K, 512)
    else:
        q, kv, idx, sink, do, out, lse = inputs(T, H, K)
    scale = 512 ** -0.5
    g = torch.Generator(device="cuda").manual_seed(T + K)
    length = (torch.randint(min(128, K), K + 1, (T,), device="cuda", generator=g).int() if with_len
              else None)
    r = dict(T=T, H=H, K=K, lengths=with_len, ids="bench" if BENCH_IDS else "side_by_side")

    def run(det, split):
        return kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                   deterministic=det, topk_length=length, split=split)

    a, b = run(True, 0), run(True, 1)
    r["det_split1_bitwise"] = all(torch.equal(x, y) for x, y in zip(a, b))
    a = b = None
    fns = {"det": lambda: run(True, 0), "det_split1": lambda: run(True, 1), "fast": lambda: run(False, None)}
    peer = None if with_len or BENCH_IDS else peer_bwd(cudnn_peer, r, q, kv, idx, sink, scale, out, lse, do)
    time_arms(r, fns, 10 * T * H * K * 512, peer)
    r["split1_change"] = round(r["det_split1_ms"] / r["det_ms"] - 1, 4)
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = fns = None
    torch.cuda.empty_cache()
