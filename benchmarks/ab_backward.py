"""A/B of the Gluon backward main kernel in one process: a saved copy against the package's.

    git show HEAD~1:src/dsv4_sparse_attn/kernels/backward_gluon.py > benchmarks/old_backward_gluon.py
    python benchmarks/ab_backward.py --old benchmarks/old_backward_gluon.py [--shapes 0,1,2]

(The copy must sit inside the repository, untracked, to travel to the device machine.)
For each bench.py shape and both modes: ms and TFLOPS (10*T*H*K*D) of the whole backward
with each main kernel, whether the gradients are bitwise equal (the deterministic path
should be, unless the change alters the arithmetic) and their largest relative difference.
Machines differ by a few percent; an A/B in one process does not.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench import SHAPES, backward_inputs, bench  # noqa: E402
import dsv4_sparse_attn.kernels as pkg  # noqa: E402
from dsv4_sparse_attn.kernels import backward as kbwd  # noqa: E402
from dsv4_sparse_attn.kernels import backward_gluon as new  # noqa: E402


def load_old(path):
    # Loaded as a sibling module so its relative imports (.backward, .common) resolve.
    spec = importlib.util.spec_from_file_location("dsv4_sparse_attn.kernels._ab_old_backward_gluon", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def use(mod):
    """backward.sparse_mla_bwd imports backward_gluon from the package at each call."""
    pkg.backward_gluon = mod
    sys.modules["dsv4_sparse_attn.kernels.backward_gluon"] = mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="path of the saved backward_gluon.py")
    ap.add_argument("--shapes", default=",".join(str(i) for i in range(len(SHAPES))),
                    help="indices into bench.SHAPES")
    a = ap.parse_args()
    old = load_old(a.old)
    T, D = 4096, 512
    for i in map(int, a.shapes.split(",")):
        H, K, name = SHAPES[i]
        q, kv, idx, sink, out, lse, do, dl = backward_inputs(T, H, K, D)
        scale = D ** -0.5
        fl = 10 * T * H * K * D
        row = [f"{name} H{H} K{K}"]
        for det in (True, False):
            res = {}
            for label, mod in (("old", old), ("new", new)):
                use(mod)
                fn = lambda: kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, scale, gluon=True,
                                                 deterministic=det)
                res[label] = (fn(), bench(fn))
            use(new)
            pairs = [(x, y) for x, y in zip(res["old"][0], res["new"][0]) if x is not None and x.numel()]
            same = all(torch.equal(x, y) for x, y in pairs)
            diff = max(((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in pairs)
            (_, ms_old), (_, ms_new) = res["old"], res["new"]
            row.append(f"{'det' if det else 'atomic'}: old {ms_old:.3f} ms ({fl / ms_old * 1e-9:.0f}) new "
                       f"{ms_new:.3f} ms ({fl / ms_new * 1e-9:.0f}) {100 * (ms_new / ms_old - 1):+.1f}% "
                       f"bitwise={same} rel.diff={diff:.1e}")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
