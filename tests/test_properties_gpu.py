"""The properties of tests/properties.py against the CUDA kernels, through the ops (the
kernel dispatch picks for each drawn shape: the Gluon kernels at D = 512 from 17 heads,
the Triton kernels elsewhere) and with the Triton kernels forced, in both backward modes.
The H200 run raises the example count (DSV4_PROPERTY_SCALE). Skipped without CUDA."""
import itertools
import os
import re
import time

import pytest
import torch
from hypothesis import given

import dsv4_sparse_attn
from dsv4_sparse_attn.kernels import dispatch
from properties import assert_matches, problems, property_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CUDA kernels)"),
]

# D = 512 drawn more than half the time (the Gluon kernels' head dim); K and N cross
# several slot blocks; T stays small (the oracle is a loop over tokens).


def gpu_problems(dtype):
    # Few distinct D and head blocks: each new (D, head block, sink) compiles every kernel
    # again, and compiling, not running, bounds this test (D = 64 and 256 are in
    # test_kernels_gpu.py); D = 576 with d_v = 512 is the V3.2 layout. Shapes that are
    # runtime values (T, K, N) vary freely.
    return problems(D=(128, 512, 512, 576), H=(0, 1, 7, 16, 24, 64, 100, 128), T=(0, 24), K=(0, 300),
                    N=(0, 600), dtypes=(dtype,), narrow_values={128: [None], 512: [None], 576: [512]})


def _shard():
    """DSV4_PROPERTY_SHARD="i/n": this process checks examples i, i + n, i + 2n, ... of each
    test, so that a slow run (under compute-sanitizer) can spread one test's examples over
    n processes. Every process draws the same examples in the same order (a fixed seed,
    and the draws do not depend on what the test does with them)."""
    v = os.environ.get("DSV4_PROPERTY_SHARD")
    if not v:
        return 0, 1
    try:
        i, n = (int(x) for x in v.split("/"))
    except ValueError:
        raise ValueError(f"DSV4_PROPERTY_SHARD={v!r}: expected 'i/n' with 0 <= i < n") from None
    if not 0 <= i < n:
        raise ValueError(f"DSV4_PROPERTY_SHARD={v!r}: expected 'i/n' with 0 <= i < n")
    return i, n


def _done():
    """DSV4_PROPERTY_DONE: an earlier run's DSV4_PROPERTY_LOG; the examples it passed are
    skipped (a sanitizer run cut by a time limit goes on where it stopped)."""
    path = os.environ.get("DSV4_PROPERTY_DONE")
    if not path or not os.path.exists(path):
        return set()
    with open(path) as f:
        return {m.group(1) for m in re.finditer(r" ok (\S+ #\d+) in ", f.read())}


def _log(line):
    """DSV4_PROPERTY_LOG: a file that gets a line per example (which one hung or was slow)."""
    path = os.environ.get("DSV4_PROPERTY_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} pid {os.getpid()} {line}\n")


def run_op(p, deterministic):
    q, kv = p.q.clone().requires_grad_(), p.kv.clone().requires_grad_()
    s = None if p.sink is None else p.sink.clone().requires_grad_()
    out, lse = torch.ops.dsv4.sparse_mla(q, kv, p.idx, s, p.scale, p.topk_length, p.d_v)
    dlse = torch.zeros_like(lse) if p.grad_lse is None else p.grad_lse
    leaves = [q, kv] + ([s] if s is not None else [])
    dsv4_sparse_attn.set_deterministic_backward(deterministic)
    try:
        grads = torch.autograd.grad([out, lse], leaves, [p.grad_out, dlse], allow_unused=True,
                                    materialize_grads=True)
    finally:
        dsv4_sparse_attn.set_deterministic_backward(None)
    return out, lse, grads[0], grads[1], (grads[2] if s is not None else None)


# One test per (kernels, mode, dtype): pytest -n runs them (and their compiles) in parallel.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "det"])
@pytest.mark.parametrize("kernels", ["dispatch", "triton"])
def test_cuda_kernels_match_the_oracle(kernels, deterministic, dtype):
    shard, n_shards = _shard()
    seen = itertools.count()
    done = _done()
    name = f"{kernels}-{'det' if deterministic else 'fast'}-{str(dtype)[6:]}"

    @given(gpu_problems(dtype))
    @property_settings(25)
    def check(p):
        k = next(seen)
        if k % n_shards != shard or f"{name} #{k}" in done:
            return
        _log(f"{name} #{k}: {p!r}")
        t0 = time.perf_counter()
        p = p.to("cuda")
        if kernels == "triton":
            with dispatch.use_kernels(forward="triton", backward="triton"):
                got = run_op(p, deterministic)
        else:
            got = run_op(p, deterministic)
        assert_matches(p, got)
        _log(f" ok {name} #{k} in {time.perf_counter() - t0:.2f} s")

    check()
