"""Triton vs Gluon kernels by head count: the data behind the dispatcher's head rule.

    python benchmarks/heads_sweep.py [--T 4096] [--heads 1,4,8,16,24,32,48] [--K 1152,512]

T=4096, D=512, DeepSeek ids (bench.py's inputs). Prints ms and TFLOPS (forward 4*T*H*K*D,
backward 10*T*H*K*D) of the forward and of both backward modes with each main kernel;
``forward_gluon.MIN_HEADS`` and ``backward_gluon.MIN_ATOMIC_HEADS`` come from this table.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench import backward_inputs, bench  # noqa: E402
from dsv4_sparse_attn.kernels import backward as kbwd  # noqa: E402
from dsv4_sparse_attn.kernels import forward as kfwd  # noqa: E402
from dsv4_sparse_attn.kernels import forward_gluon  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--heads", default="1,4,8,16,24,32,48")
    ap.add_argument("--K", default="1152,512")
    a = ap.parse_args()
    T, D = a.T, 512
    print("| H | K | fwd Triton | fwd Gluon | bwd det Triton | bwd det Gluon | bwd atomic Triton "
          "| bwd atomic Gluon |  (ms, TFLOPS)")
    print("|---" * 8 + "|")
    for K in map(int, a.K.split(",")):
        for H in map(int, a.heads.split(",")):
            q, kv, idx, sink, out, lse, do, dl = backward_inputs(T, H, K, D)
            cells = []
            for fn in (kfwd.sparse_mla_fwd, forward_gluon.sparse_mla_fwd):
                ms = bench(lambda: fn(q, kv, idx, sink, D ** -0.5), rep=50)
                cells.append(f"{ms:.3f} ({4 * T * H * K * D / ms * 1e-9:.0f})")
            for det in (True, False):
                for gluon in (False, True):
                    ms = bench(lambda: kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, D ** -0.5,
                                                           deterministic=det, gluon=gluon), rep=50)
                    cells.append(f"{ms:.3f} ({10 * T * H * K * D / ms * 1e-9:.0f})")
            print(f"| {H} | {K} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
