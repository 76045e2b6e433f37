"""Workload for ``ncu_peer.sh``: the fast backward's Gluon main kernel (split 2, the
default under Triton 3.6-3.8) and cuDNN-frontend's sm90 DSA main kernel on the same
inputs (cuDNN's side-by-side ids), each called ``--calls`` times, so that ncu can profile
one warm launch of each (``--launch-skip``).

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/ncu_peer.py PEER_DIR [--T --H --K]

Both kernels issue about the same instructions a block (docs/performance/backward.md,
instruction counts next to cuDNN); the profile says where each one waits.
"""
import argparse
import sys

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import inputs  # (this directory)

ap = argparse.ArgumentParser()
ap.add_argument("peer", help="the cuDNN peer kit's folder (cudnn_peer.py)")
ap.add_argument("--T", type=int, default=4096)
ap.add_argument("--H", type=int, default=64)
ap.add_argument("--K", type=int, default=640)
ap.add_argument("--calls", type=int, default=3)
ap.add_argument("--only", choices=("ours", "cudnn"), default=None)
a = ap.parse_args()
sys.path.insert(0, a.peer)
import cudnn_peer  # noqa: E402

D = 512
q, kv, idx, sink, do, out, lse = inputs(a.T, a.H, a.K, D)
scale = D ** -0.5
runs = {
    "ours": lambda: kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                        deterministic=False),
    "cudnn": cudnn_peer.make_bwd(q, kv, idx, sink, scale, out, lse, do),
}
for name, fn in runs.items():
    if a.only in (None, name):
        for _ in range(a.calls):
            fn()
        torch.cuda.synchronize()
        print(name, "done", flush=True)
