"""The deterministic fold's tile (``backward.fold_tile``: kv rows side by side, entries a
step, warps) timed through the whole deterministic backward, and checked bitwise against
the default tile (any tile must give the same bits), on the sweep's causal inputs.

    PYTHONPATH=src:tests:benchmarks python benchmarks/experiments/fold_tile_bench.py > fold.jsonl

Per (T, H, K): the backward with each tile, the median of a few calls (CUDA events), and
whether its gradients equal the default tile's bit for bit.
"""
import json
import statistics
import sys
import time

import torch

from bench import backward_mode, event_times, make_inputs
from dsv4_sparse_attn.kernels import backward as kbwd

TILES = ((1, 8, 4), (4, 4, 4), (8, 4, 4), (8, 4, 8), (16, 4, 8))
SHAPES = ((131072, 64, 640), (4096, 64, 640), (32768, 64, 640))


def timed(fn, calls):
    fn()
    torch.cuda.synchronize()
    return statistics.median(event_times(fn, calls))


def shape(T, H, K, t0):
    D, default = 512, kbwd.fold_tile
    q, kv, idx, sink = make_inputs(T, H, K, D, pool="causal", n_pool=max(T // 4, K))
    out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None)
    do = torch.randn_like(out)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    bwd = lambda: torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, None)  # noqa: E731
    calls = 3 if T > 32768 else 10
    with backward_mode(True):
        ref = bwd()
        for tile in TILES:
            kbwd.fold_tile = lambda N, n, tile=tile: tile
            try:
                g = bwd()
                same = all(torch.equal(a, b) for a, b in zip(ref, g))
                ms = timed(bwd, calls)
                del g
            finally:
                kbwd.fold_tile = default
            print(json.dumps(dict(T=T, H=H, K=K, tile=tile, default=tile == default(kv.shape[0], n_sm),
                                  ms=round(ms, 3), tflops=round(10 * T * H * K * D / ms / 1e9, 1),
                                  bitwise_same=same, t_s=round(time.time() - t0, 1))), flush=True)


def main():
    t0 = time.time()
    for T, H, K in SHAPES:
        shape(T, H, K, t0)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
