"""The op's host time by layer, in a steady state (calls queued back to back while the GPU
is behind, as in training): each function on the call's path wrapped by a timer
(inclusive time a call, and calls a call), for the forward and both backward modes.

    PYTHONPATH=src:benchmarks:benchmarks/experiments \
        python benchmarks/experiments/host_layers_bench.py out.jsonl

(docs/performance/backward.md#a-calls-host-time-taken-apart-measured)
"""
import collections
import json
import sys

import torch
from triton.runtime import jit as _jit

import dsv4_sparse_attn
from dsv4_sparse_attn import ops
from dsv4_sparse_attn.kernels import backward as _bwd
from dsv4_sparse_attn.kernels import backward_gluon as _bg
from dsv4_sparse_attn.kernels import dispatch
from dsv4_sparse_attn.kernels import forward_gluon as _fg
from host_gap_bench import case, steady_us, timed, write_jsonl  # (this directory)

ROWS = [(4096, 64, 640), (4096, 64, 160), (4096, 128, 1152)]
acc = collections.defaultdict(lambda: [0.0, 0])


def _add(name, dt):
    r = acc[name]
    r[0] += dt
    r[1] += 1


def patch():
    saved = []

    def put(obj, attr, name):
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, timed(getattr(obj, attr), lambda a, dt: _add(name, dt)))

    put(ops, "_bwd_cuda", "ops._bwd_cuda")
    put(ops, "_fwd_cuda", "ops._fwd_cuda")
    put(ops, "check_backward", "check_backward")
    put(ops, "check_forward", "check_forward")
    put(dispatch, "backward", "dispatch.backward")
    put(dispatch, "forward", "dispatch.forward")
    put(dispatch, "choose", "dispatch.choose")
    put(_bwd, "sparse_mla_bwd", "backward.sparse_mla_bwd")
    put(_bwd, "epilogue", "backward.epilogue")
    put(_bwd, "last_dim_contiguous", "last_dim_contiguous")
    put(_bg, "launch", "backward_gluon.launch")
    put(_bg, "_qd_descriptor", "_qd_descriptor")
    put(_fg, "sparse_mla_fwd", "forward_gluon.sparse_mla_fwd")
    for name in ("sort", "searchsorted", "zeros", "empty", "arange"):
        put(torch, name, "torch." + name)
    orig_run = _jit.JITFunction.run
    saved.append((_jit.JITFunction, "run", orig_run))
    _jit.JITFunction.run = timed(orig_run, lambda a, dt: _add("jit " + a[0].fn.__name__, dt))
    return saved


def main():
    rows = []
    for T, H, K in ROWS:
        D = 512
        q, kv, idx, sink, scale, out, lse, do = case(T, H, K, D)
        bwd = lambda: torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale)  # noqa: E731
        calls = {"fwd": (None, lambda: torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, scale)),
                 "fast": (False, bwd), "det": (True, bwd)}
        for mode, (det, fn) in calls.items():
            dsv4_sparse_attn.set_deterministic_backward(det)
            n = 10 if det else 30
            plain = steady_us(fn, n)
            acc.clear()
            saved = patch()
            try:
                wrapped = steady_us(fn, n)  # (the layers' timers count its warm-up call too)
            finally:
                for obj, attr, v in reversed(saved):
                    setattr(obj, attr, v)
            r = dict(T=T, H=H, K=K, mode=mode, op_us=plain, op_us_wrapped=wrapped,
                     layers={k: [round(v[0] * 1e6 / (n + 1), 1), v[1] / (n + 1)] for k, v in
                             sorted(acc.items(), key=lambda kv: -kv[1][0])})
            rows.append(r)
            print(json.dumps(r), flush=True)
        dsv4_sparse_attn.set_deterministic_backward(None)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        write_jsonl(sys.argv[1], rows)


if __name__ == "__main__":
    main()
