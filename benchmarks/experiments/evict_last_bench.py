"""The fast backward's whole-line reductions with and without an L2 evict-last policy
(``backward_gluon.launch(evict_last=...)``), at context lengths where the fp32 [N, D]
accumulator outgrows the H200's L2 (T = 32768: 84 MB; 131072: 335 MB) and at T = 4096
(10 MB: no change expected), timed A, B, A, B in one process.

    PYTHONPATH=src:tests python benchmarks/experiments/evict_last_bench.py > evict_last.jsonl

Inputs as in ``bench.py --backward-sweep`` (window + distinct pool ids, causal pool ids at
T = 131072; D = 512, bf16, a sink, no grad_lse). grad_kv of the two arms is compared
(fp32 atomics: equal up to the order of the adds).
"""
import json
import os

import triton

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import pool_inputs, relerr

D = 512
ROWS = [(4096, 64, 640, "distinct"), (32768, 64, 640, "distinct"), (32768, 128, 1152, "distinct"),
        (131072, 64, 640, "causal"), (131072, 128, 1152, "causal")]
# EVICT_ROWS="1,3": rows of ROWS (default the first four); EVICT_REPS: A, B passes (default 2)
ROWS = [ROWS[int(i)] for i in os.environ.get("EVICT_ROWS", "0,1,2,3").split(",")]
REPS = int(os.environ.get("EVICT_REPS", "2"))


for T, H, K, ids in ROWS:
    q, kv, idx, sink, do, out, lse = pool_inputs(T, H, K, ids)

    def run(ev):
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5, main=backward_gluon,
                                   deterministic=False, evict_last=ev)

    r = dict(T=T, H=H, K=K, ids=ids, err_dkv=relerr(run(True)[1].float(), run(False)[1].float()))
    fl = 10 * T * H * K * D
    for rep in range(REPS):
        for name, ev in (("plain", False), ("evict_last", True)):
            ms = triton.testing.do_bench(lambda: run(ev), warmup=3, rep=40 if T <= 32768 else 200,
                                         return_mode="median")
            r[f"{name}_ms_{rep}"] = ms
            r[f"{name}_tflops_{rep}"] = round(fl / ms * 1e-9, 1)
    print(json.dumps(r), flush=True)
