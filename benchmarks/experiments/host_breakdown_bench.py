"""Where a call's host time goes, without a profiler's own cost: the op's host time (median
of 30 calls, the GPU idle at each call's start) next to the same call one layer down (the
registered CUDA kernel without the custom-op wrapper, the backward without validation and
dispatch), and each Triton launch's own host time (JITFunction.run timed by a wrapper),
the Gluon launch's TMA descriptors, and a launch through the compiled kernel's own runner.

    PYTHONPATH=src:benchmarks:benchmarks/experiments python benchmarks/experiments/host_breakdown_bench.py

(docs/performance/backward.md#a-calls-host-time-taken-apart-measured: host_path_profile.py's
cProfile could not say what the custom op's wrapper costs.)
"""
import collections
import json
import statistics
import sys

import torch
import triton
from triton.runtime import jit as _jit

import dsv4_sparse_attn
from dsv4_sparse_attn import ops
from dsv4_sparse_attn.kernels import backward as _bwd
from dsv4_sparse_attn.kernels import backward_gluon as _bg
from dsv4_sparse_attn.kernels import dispatch
from dsv4_sparse_attn.validation import check_backward
from host_gap_bench import case, host_us, timed, write_jsonl  # (this directory)

ROWS = [(4096, 64, 640), (4096, 64, 160), (4096, 128, 1152)]
N_CALLS = 30

_launch_us = collections.defaultdict(list)
_orig_run = _jit.JITFunction.run
_orig_desc = _bg._qd_descriptor
# each launch's own host time (JITFunction.run by kernel) and each descriptor's, us
_timed_run = timed(_orig_run, lambda a, dt: _launch_us[a[0].fn.__name__].append(dt * 1e6))
_timed_desc = timed(_orig_desc, lambda a, dt: _launch_us["_qd_descriptor"].append(dt * 1e6))


def main():
    out_rows = []
    for T, H, K in ROWS:
        D = 512
        q, kv, idx, sink, scale, out, lse, do = case(T, H, K, D)
        p = check_backward(do, None, q, kv, out, lse, idx, sink, scale, None, None)
        arms = {
            "fwd op": lambda: torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, scale),
            "fwd kernel fn": lambda: ops._fwd_cuda(q, kv, idx, sink, scale),
            "bwd op": lambda: torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale),
            "bwd kernel fn": lambda: ops._bwd_cuda(do, None, q, kv, out, lse, idx, sink, scale),
            "bwd dispatch": lambda: dispatch.backward(do, None, q, kv, out, lse, idx, sink, p),
            "check_backward": lambda: check_backward(do, None, q, kv, out, lse, idx, sink, scale, None, None),
        }
        for det in (False, True):
            dsv4_sparse_attn.set_deterministic_backward(det)
            mode = "det" if det else "fast"
            for name, fn in arms.items():
                if name.startswith("fwd") and det:
                    continue
                fn()
                torch.cuda.synchronize()
                us = host_us(fn)
                row = dict(T=T, H=H, K=K, mode=mode, arm=name, host_us=round(us, 1))
                out_rows.append(row)
                print(json.dumps(row), flush=True)
            # each launch's own host time, over N_CALLS op calls
            _launch_us.clear()
            _jit.JITFunction.run = _timed_run
            _bg._qd_descriptor = _timed_desc
            try:
                host_us(arms["bwd op"])
            finally:
                _jit.JITFunction.run = _orig_run
                _bg._qd_descriptor = _orig_desc
            for k, v in sorted(_launch_us.items()):
                row = dict(T=T, H=H, K=K, mode=mode, arm="launch " + k, calls_per_op=len(v) / N_CALLS,
                           median_us=round(statistics.median(v), 1),
                           total_us_per_op=round(sum(v) / N_CALLS, 1))
                out_rows.append(row)
                print(json.dumps(row), flush=True)
        dsv4_sparse_attn.set_deterministic_backward(None)
        # Delta's launch: JIT path against the compiled kernel's runner
        delta = torch.empty((T, H), dtype=torch.float32, device=q.device)
        dh = min(triton.next_power_of_2(H), 16)
        args = (out, do, delta, delta, H, out.stride(0), out.stride(1), do.stride(0), do.stride(1), 0)
        consts = dict(D=D, BLOCK_H=dh, HAS_DLSE=False)
        grid = (T, triton.cdiv(H, dh), 1)
        jit_launch = lambda: _bwd._bwd_delta_kernel[grid](*args, **consts, num_warps=4)  # noqa: E731
        jit_launch()
        ck = _bwd._bwd_delta_kernel.warmup(*args, **consts, num_warps=4, grid=grid)
        runner = ck[grid]
        direct = lambda: runner(*args, *consts.values())  # noqa: E731
        direct()
        dev = torch.cuda.current_device()
        stream = torch.cuda.current_stream().cuda_stream
        fn, pm = ck.function, ck.packed_metadata
        bare = lambda: ck.run(grid[0], grid[1], grid[2], stream, fn, pm, None, None, None,  # noqa: E731
                              *args, *consts.values())
        bare()
        for name, f in (("delta jit launch", jit_launch), ("delta compiled runner", direct),
                        ("delta launcher only", bare),
                        ("torch.empty", lambda: torch.empty((T, H), dtype=torch.float32, device=q.device)),
                        ("torch.zeros [N,D]", lambda: torch.zeros((kv.shape[0], D), dtype=torch.float32,
                                                                  device=q.device))):
            row = dict(T=T, H=H, K=K, arm=name, host_us=round(host_us(f, 200), 1), device=dev)
            out_rows.append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        write_jsonl(sys.argv[1], out_rows)


if __name__ == "__main__":
    main()
