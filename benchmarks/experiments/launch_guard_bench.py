"""Host cost of what every CUDA call now does before its kernels: the tensors' GPU made
current (``dispatch.on_device``), PyTorch's deterministic fill checked and left off
(``dispatch.unfilled_allocations``) and q, kv, dO checked for the Gluon gathers'
alignment (``common.aligned16``). A, B, A, B in one process: the step (forward +
backward through ``torch.ops.dsv4.sparse_mla``, fast mode) and the backward op alone, with
the three as shipped (A) and replaced by no-ops (B), at a host-bound shape (H64 K160) and
a GPU-bound one (H64 K640). Wall ms a call (median of CUDA-event timed calls, no L2 flush,
so the host's enqueue time shows where it exceeds the GPU's).

    PYTHONPATH=src python benchmarks/experiments/launch_guard_bench.py
"""
import contextlib
import json
import statistics

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import dispatch, forward_gluon
from dsv4_sparse_attn.testing import deepseek_indices


def wall_ms(fn, calls=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


@contextlib.contextmanager
def guards(on):
    """A: as shipped; B: the three replaced by no-ops."""
    if on:
        yield
        return
    saved = [(dispatch, "on_device"), (dispatch, "unfilled_allocations"),
             (kbwd, "aligned16"), (forward_gluon, "aligned16")]
    saved = [(m, n, getattr(m, n)) for m, n in saved]
    dispatch.on_device = lambda t: contextlib.nullcontext()
    dispatch.unfilled_allocations = contextlib.nullcontext
    kbwd.aligned16 = forward_gluon.aligned16 = lambda x: x
    try:
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


def main():
    dsv4_sparse_attn.set_deterministic_backward(False)
    rows = []
    for H, K in ((64, 160), (64, 640)):
        T, D = 4096, 512
        N = T + T // 4
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        idx = deepseek_indices(T, K, device="cuda")
        sink = torch.randn(H, device="cuda")
        do = torch.randn_like(q)
        qg, kvg, sg = (x.detach().requires_grad_() for x in (q, kv, sink))
        out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink)

        def step():
            o, _ = torch.ops.dsv4.sparse_mla(qg, kvg, idx, sg)
            return torch.autograd.grad(o, (qg, kvg, sg), do)

        def bwd():
            return torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink)

        res = {"H": H, "K": K}
        for rnd in range(2):
            for arm, on in (("A", True), ("B", False)):
                with guards(on):
                    res.setdefault(f"step_{arm}", []).append(wall_ms(step))
                    res.setdefault(f"bwd_{arm}", []).append(wall_ms(bwd))
        rows.append(res)
        print(json.dumps(res), flush=True)
    return rows


if __name__ == "__main__":
    main()
