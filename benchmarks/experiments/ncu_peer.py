"""Workload for ``ncu_peer.sh``, and a per-kernel breakdown of the fast backward next to
cuDNN-frontend's sm90 DSA backward on the same inputs (cuDNN's side-by-side ids).

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/ncu_peer.py PEER [--T --H --K] [--only ours]
    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/ncu_peer.py PEER --kernels > kernels.jsonl

The first form calls each backward ``--calls`` times (ncu profiles one warm launch of each
main kernel: ``--launch-skip``). ``--kernels``: for each shape of a K sweep, every GPU
kernel's time in one call of each backward (torch.profiler, 5 calls), so the
main kernels can be compared alone and the fixed costs (Delta / dPsum, zeroing, the
conversion, grad_sink) apart. Both kernels issue about the same instructions a block
(docs/performance/backward.md, instruction counts next to cuDNN); from the K sweep, a
tile's fixed cost and a block's cost of each, by a straight line through time per tile
against blocks per tile.
"""
import argparse
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import inputs  # (this directory)

D = 512
SWEEP = [(4096, 128, 128), (4096, 128, 256), (4096, 128, 512), (4096, 128, 768), (4096, 128, 1152),
         (4096, 64, 160), (4096, 64, 384), (4096, 64, 640), (4096, 64, 1152)]


def causal_inputs(T, H, K, d=D, d_v=None):
    """The backward sweep's causal ids (bench.py: a window of 128 rows, then distinct pool rows
    p < t/4 of a pool of max(T/4, K) rows, -1 where it is short), seed 0, with out and lse
    from the forward; ``d``, ``d_v``: q and kv ``d`` wide, values the first ``d_v`` columns
    (the 576/512 layout)."""
    from bench import make_inputs  # (benchmarks/ on the path)
    q, kv, idx, sink = make_inputs(T, H, K, d, pool="causal", n_pool=max(T // 4, K))
    out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, d ** -0.5, None, d_v)
    return q, kv, idx, sink, torch.randn_like(out), out, lse


def backwards(cudnn_peer, T, H, K, ids="distinct", **options):
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D) if ids == "distinct" else causal_inputs(T, H, K)
    scale = D ** -0.5
    return {
        "ours": lambda: kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                            deterministic=False, **options),
        "cudnn": cudnn_peer.make_bwd(q, kv, idx, sink, scale, out, lse, do),
    }


def kernel_times(fn, calls=5):
    """Each kernel's CUDA time (us) in one call of ``fn``: the total over ``calls`` calls
    (torch.profiler's key averages) divided by ``calls``."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    # (keys cut to 60 characters: kernels that share the prefix, as cuDNN's pre-, main and
    # post-processing kernels do, are summed, not overwritten)
    times = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            times[e.key[:60]] = times.get(e.key[:60], 0.0) + e.device_time_total / calls
    return {k: round(v, 1) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("peer", help="the cuDNN peer kit's folder (cudnn_peer.py)")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--K", type=int, default=640)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--only", choices=("ours", "cudnn"), default=None)
    ap.add_argument("--kernels", action="store_true", help="per-kernel times over the K sweep")
    ap.add_argument("--ids", choices=("distinct", "causal"), default="distinct",
                    help="cuDNN's side-by-side ids, or the sweep's causal ones (its T = 131072 rows)")
    ap.add_argument("--evict-last", action="store_true", help="ours with launch(evict_last=True)")
    a = ap.parse_args()
    sys.path.insert(0, a.peer)
    import cudnn_peer

    if a.kernels:
        for T, H, K in SWEEP:
            r = dict(T=T, H=H, K=K, tiles=T * -(-H // 64), blocks_per_tile=-(-K // 64))
            for name, fn in backwards(cudnn_peer, T, H, K).items():
                r[name] = kernel_times(fn)
            print(json.dumps(r), flush=True)
            torch.cuda.empty_cache()
        return
    options = dict(evict_last=True) if a.evict_last else {}
    for name, fn in backwards(cudnn_peer, a.T, a.H, a.K, a.ids, **options).items():
        if a.only in (None, name):
            for _ in range(a.calls):
                fn()
            torch.cuda.synchronize()
            print(name, "done", flush=True)


if __name__ == "__main__":
    main()
