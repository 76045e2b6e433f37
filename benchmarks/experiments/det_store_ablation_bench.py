"""What the deterministic mode's 16-bit partial-row stores cost its main kernel: the whole
deterministic backward (Gluon main kernel, 16-bit rows) with the stores as shipped, with
them predicated off at run time (``launch(ablate=8)``: still issued, no bytes written),
predicated off and not scaled (``ablate=8 | 1024``: the segment maxima, scales and
multiplies left out) and left out of the build (``ablate=512``: no store instructions,
and ptxas then drops the scaling and, in part, the dKV products no store reads); and the
rows as bf16, unscaled (``backward.PARTIAL_16_BF16``: real gradients). The fold and the
rest run the same in every arm (but the bf16 one's fold, which reads no scale words), so
the differences are the main kernel's. The gradients of the ablated
arms are wrong; the times are the point. The fast mode is timed beside them.

    PYTHONPATH=src:tests:benchmarks:benchmarks/experiments \
        python benchmarks/experiments/det_store_ablation_bench.py > det_store_ablation.jsonl

One JSON line per shape: ms (do_bench median) of each arm, best of PASSES passes (A, B,
C, D, then reversed).
"""
import json
import os

import triton.testing

from bench import backward_inputs
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import env_shapes, with_flags

SHAPES = ((4096, 64, 640), (4096, 128, 1152), (4096, 16, 1152))
ARMS = (("det", True, 0), ("det_stores_off", True, 8), ("det_stores_off_unscaled", True, 8 | 1024),
        ("det_no_stores", True, 512), ("det_bf16_rows", True, "bf16"), ("fast", False, 0))


def main():
    passes = int(os.environ.get("PASSES", 2))
    for T, H, K in env_shapes(SHAPES):
        q, kv, idx, sink, out, lse, do, dl = backward_inputs(T, H, K, 512)

        def call(det, ablate):
            if ablate == "bf16":  # (the bf16 rows option: real gradients, another rounding)
                return with_flags(kbwd, call(det, 0), PARTIAL_16_BF16=True)
            return lambda: kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, 512 ** -0.5,
                                               main=backward_gluon, deterministic=det, ablate=ablate)
        row = dict(T=T, H=H, K=K)
        for i in range(passes):
            for name, det, ablate in (ARMS if i % 2 == 0 else ARMS[::-1]):
                f = call(det, ablate)
                f()
                row[f"{name}_ms_{i}"] = round(triton.testing.do_bench(f, warmup=25, rep=200), 4)
        for name, _, _ in ARMS:
            row[name + "_best"] = min(row[f"{name}_ms_{i}"] for i in range(passes))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
