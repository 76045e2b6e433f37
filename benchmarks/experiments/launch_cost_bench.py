"""A Triton launch's host time taken apart, for the backward's Gluon main kernel and the
Delta kernel: JITFunction.run's steps (the argument binder and specialisation, the cache
key, the check of the kernel's global constants, launch metadata, the launcher) timed one
by one on the arguments of a real call; the TMA descriptor's construction (its shared
layout and the descriptor object); and the op's host time in a steady state (calls queued
back to back while the GPU is behind: the host's own rate, as in training, where the GPU
is not idle at each call's start).

    PYTHONPATH=src:benchmarks:benchmarks/experiments \
        python benchmarks/experiments/launch_cost_bench.py out.jsonl

(docs/performance/backward.md#a-calls-host-time-taken-apart-measured)
"""
import json
import statistics
import sys
import time

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime import jit as _jit

import dsv4_sparse_attn
from dsv4_sparse_attn.kernels import backward_gluon as _bg
from host_gap_bench import case, steady_us, write_jsonl  # (this directory)

ROWS = [(4096, 64, 640), (4096, 64, 160), (4096, 128, 1152)]
rows = []


def emit(**r):
    rows.append(r)
    print(json.dumps(r), flush=True)


def med_us(fn, n=200):
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(ts), 2)


def run_steps(jf, args, kwargs, grid, shape):
    """JITFunction.run's steps (Triton 3.6), each timed; args/kwargs as the launch got them."""
    device = driver.active.get_current_device()
    kernel_cache, kernel_key_cache, target, backend, binder = jf.device_caches[device]
    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", jf.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound_args, spec, options = binder(*args, **kw)
    key = _jit.compute_cache_key(kernel_key_cache, spec, options)
    kernel = kernel_cache[key]
    stream = driver.active.get_current_stream(device)
    vals = list(bound_args.values())
    not_present = object()

    def globals_check():
        for (name, _), (val, g) in jf.used_global_vals.items():
            if g.get(name, not_present) != val:
                raise RuntimeError(name)

    steps = {
        "device+stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
        "binder": lambda: binder(*args, **kw),
        "cache key": lambda: _jit.compute_cache_key(kernel_key_cache, spec, options),
        "globals check": globals_check,
        "launch_metadata": lambda: kernel.launch_metadata(grid, stream, *vals),
        "launcher": lambda: kernel.run(grid[0], grid[1], grid[2], stream, kernel.function,
                                       kernel.packed_metadata, None, None, None, *vals),
        "whole run": lambda: jf.run(*args, grid=grid, warmup=False, **kwargs),
    }
    for name, fn in steps.items():
        emit(shape=shape, kernel=jf.fn.__name__, step=name, us=med_us(fn), n_args=len(vals),
             n_globals=len(jf.used_global_vals))
    torch.cuda.synchronize()


def main():
    captured = {}
    orig = _jit.JITFunction.run

    def capture(self, *args, grid, warmup, **kwargs):
        captured.setdefault(self.fn.__name__, (self, args, kwargs, grid))
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    for T, H, K in ROWS:
        D = 512
        shape = f"H{H} K{K}"
        q, kv, idx, sink, scale, out, lse, do = case(T, H, K, D)
        bwd = lambda: torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale)  # noqa: E731
        fwd = lambda: torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, scale)  # noqa: E731
        dsv4_sparse_attn.set_deterministic_backward(False)
        captured.clear()
        _jit.JITFunction.run = capture
        try:
            bwd()
        finally:
            _jit.JITFunction.run = orig
        torch.cuda.synchronize()
        for name in ("_bwd_main_gluon_kernel", "_bwd_delta_kernel"):
            jf, args, kwargs, grid = captured[name]
            grid = tuple(grid) + (1,) * (3 - len(grid))
            run_steps(jf, args, kwargs, grid, shape)
        layout = _bg.gl.NVMMASharedLayout.get_default_for
        emit(shape=shape, step="layout get_default_for",
             us=med_us(lambda: layout([1, _bg.BLOCK_H, 128], _bg._GL_DTYPES[q.dtype])))
        emit(shape=shape, step="_qd_descriptor", us=med_us(lambda: _bg._qd_descriptor(q)))
        for det in (False, True):
            dsv4_sparse_attn.set_deterministic_backward(det)
            emit(shape=shape, step="steady bwd op", det=det, us=steady_us(bwd, 20 if det else 40))
        dsv4_sparse_attn.set_deterministic_backward(None)
        emit(shape=shape, step="steady fwd op", us=steady_us(fwd))
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        write_jsonl(sys.argv[1], rows)


if __name__ == "__main__":
    main()
