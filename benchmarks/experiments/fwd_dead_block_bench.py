"""The Gluon forward skipping a tile's last odd block where it lies wholly past K
(``forward_gluon.SKIP_DEAD_ODD_BLOCK``: the ``DEAD`` build where 0 < K % 128 <= 64) against
computing it masked, timed A, B, B, A, ... in one process; outputs compared bitwise.

    PYTHONPATH=src:tests:benchmarks:benchmarks/experiments \\
        python benchmarks/experiments/fwd_dead_block_bench.py

The consumers take a tile's 64-slot blocks in pairs (S of the even block on consumer 0, of
the odd one on consumer 1); at K = 160 (V4's HCA: 3 blocks) the second pair's odd block is
all masked ids, yet it was gathered (zero-filled), its S computed and its P V applied.

Prediction: at K = 160 a tile costs 3.5 blocks' time instead of 4 (consumer 1 idles through
the dead block's S, P and P V; consumer 0 still does its block's): 10-14% less forward
time at H64 K160 and H128 K160, 3-6% at K = 300 (5 blocks of 6); K = 640 and 1152 (no dead
block: the same build) unchanged.
"""
import json
import os

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import forward_gluon as F
from side_by_side import bench, inputs

ROWS = [(4096, 64, 160), (4096, 128, 160), (4096, 64, 300), (4096, 128, 130), (4096, 64, 640),
        (4096, 128, 1152)]


def run(q, kv, idx, sink, skip):
    F.SKIP_DEAD_ODD_BLOCK = skip
    return F.sparse_mla_fwd(q, kv, idx, sink, q.shape[-1] ** -0.5)


def main():
    reps = int(os.environ.get("DEAD_REPS", "4"))
    for T, H, K in ROWS:
        q, kv, idx, sink = inputs(T, H, K)[:4]
        a, b = run(q, kv, idx, sink, False), run(q, kv, idx, sink, True)
        row = dict(T=T, H=H, K=K, dead=F.dead_odd_block(K, False), out_bitwise=bool(torch.equal(a[0], b[0])),
                   lse_bitwise=bool(torch.equal(a[1], b[1])))
        arms = [("masked", False), ("skipped", True)]
        for r in range(reps):
            for name, skip in arms if r % 2 == 0 else arms[::-1]:
                row.setdefault(name, []).append(round(bench(lambda: run(q, kv, idx, sink, skip)), 4))
        for name, _ in arms:
            v = sorted(row[name])
            row[f"{name}_median"] = round((v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2, 4)
            row[f"{name}_tflops"] = round(4 * T * H * K * 512 / row[f"{name}_median"] / 1e9, 1)
        print(json.dumps(row), flush=True)
    F.SKIP_DEAD_ODD_BLOCK = True


if __name__ == "__main__":
    main()
