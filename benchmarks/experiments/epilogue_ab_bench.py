"""The backward's one-launch epilogue against the launches it replaced, in one process: the
checkout's ``backward.sparse_mla_bwd`` against another commit's (``BASE_BACKWARD``: that
commit's ``src/dsv4_sparse_attn/kernels/backward.py``, e.g. 13b0a15's: the conversion, the
sink's parts, PyTorch's sum of them, two memsets and the Gluon launch's own dQ-parts sum),
both around the checkout's Gluon main kernel, both modes.

    git show 13b0a15:src/dsv4_sparse_attn/kernels/backward.py > .peers/backward_base.py
    PYTHONPATH=src:benchmarks:benchmarks/experiments python benchmarks/experiments/epilogue_ab_bench.py

(``BASE_BACKWARD``, default ``.peers/backward_base.py``; on the device machine:
``NEXT_TESTS="epilogue or remainder" NEXT_BENCH=epilogue_ab_bench.py bash
benchmarks/gpu_session.sh next``, whose rows are this script's output.)

Per row and mode: the host time a call in the steady state (calls queued back to back, the
GPU behind: ``host_gap_bench.steady_us``) and the time a call with the GPU waiting on
nothing but the calls (CUDA events around 20 calls), each the better of its passes in
alternating order (``side_by_side.best_of_ab``). Checks first:
the deterministic mode's grad_q and grad_kv bitwise equal between the arms and grad_sink
within 1e-5 (its parts are summed in another order), the fast mode's gradients against the
deterministic ones. Prediction: about 190 us less host time a fast call at H64 K640 (145
deterministic), the GPU time level
(docs/performance/backward.md#one-epilogue-launch-kept-host-time-measured).
"""
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench.py
import dsv4_sparse_attn  # noqa: F401,E402
from dsv4_sparse_attn.kernels import backward as kbwd  # noqa: E402
from dsv4_sparse_attn.kernels import backward_gluon  # noqa: E402
from dsv4_sparse_attn.testing import relerr  # noqa: E402
from host_gap_bench import case, steady_us  # noqa: E402  (this directory)
from side_by_side import best_of_ab  # noqa: E402

ROWS = [(4096, 64, 640), (4096, 64, 160), (4096, 128, 1152)]


def load_base(path):
    """The module at ``path`` as a sibling of ``backward`` (its relative imports work)."""
    spec = importlib.util.spec_from_file_location("dsv4_sparse_attn.kernels._backward_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def call_ms(fn, n=20):
    """ms a call over ``n`` calls launched back to back from an idle GPU (host gaps included)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def main():
    base = load_base(os.environ.get("BASE_BACKWARD", ".peers/backward_base.py"))
    rounds = int(os.environ.get("EPILOGUE_ROUNDS", "2"))
    for T, H, K in ROWS:
        q, kv, idx, sink, scale, out, lse, do = case(T, H, K)
        for det in (False, True):
            fns = {name: (lambda mod=mod, det=det: mod.sparse_mla_bwd(
                do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon, deterministic=det))
                for name, mod in (("new", kbwd), ("base", base))}
            r = dict(T=T, H=H, K=K, mode="det" if det else "fast")
            new, old = fns["new"](), fns["base"]()
            if det:
                r["bitwise_q_kv"] = torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
                r["err_sink"] = relerr(new[2], old[2])
            else:
                ref = kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                          deterministic=True)
                r.update({f"{n}_err_{g}": relerr(got[i], ref[i]) for n, got in (("new", new), ("base", old))
                          for i, g in enumerate(("dq", "dkv", "sink"))})
            new = old = ref = None
            n_calls = 10 if det else 30
            for n, us in best_of_ab(fns, 2 * rounds, timer=lambda fn: steady_us(fn, n_calls)).items():
                r[f"{n}_host_us"] = us
            for n, ms in best_of_ab(fns, 2 * rounds, timer=call_ms).items():
                r[f"{n}_ms"] = round(ms, 4)
            print(json.dumps(r), flush=True)
        q = kv = idx = do = out = lse = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
