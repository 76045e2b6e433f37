"""torch.compile (inductor) of models and functions that call the dsv4 ops: CPU, and CUDA where present."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import dsv4_sparse_attn  # noqa: F401  (registers torch.ops.dsv4.*)
from dsv4_sparse_attn import SparseMLAAttention
from helpers import relerr

DIM, H, D = 16, 4, 8

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)")

# Per device: (dim, H, D, dtype, tolerance on ||compiled - eager|| / ||eager||).
# CPU: fp32 through the reference; the graphs differ only in fp32 rounding.
# CUDA: bf16 with D=128, so the Triton kernels run; inductor fuses the projections, the
# bias adds and the loss differently from eager and rounds their outputs to bf16 at other
# points, hence ~2e-2 (a wrong gradient is off by O(1)).
CONFIGS = {
    "cpu": (DIM, H, D, torch.float32, 1e-5),
    "cuda": (256, 8, 128, torch.bfloat16, 2e-2),
}


def _step(fn, model, x, idx):
    """One forward/backward through ``fn`` (the model or its compiled wrapper)."""
    model.zero_grad(set_to_none=True)
    y, lse = fn(x, idx, return_lse=True)
    (y.float().square().mean() + 0.1 * lse.mean()).backward()
    return y.detach(), lse.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _inputs(T, K, dim, dtype, device):
    x = torch.randn(T, dim, device=device).to(dtype)
    idx = torch.randint(-1, T + 1, (T, K), dtype=torch.int32, device=device)  # some masked, some >= N
    idx[0] = -1  # an empty row (lse = sink)
    return x, idx


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_compiled_module_matches_eager_without_recompiles(device):
    dim, n_heads, head_dim, dtype, tol = CONFIGS[device]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them: earlier tests' graphs would count
    torch.manual_seed(0)
    # q / kv projections, a learnable fp32 sink, dsv4::sparse_mla, an output projection.
    model = SparseMLAAttention(dim, n_heads, head_dim, scale=head_dim ** -0.5, bias=True,
                               device=device, dtype=dtype)
    with torch.no_grad():
        model.attn_sink.normal_()
    assert model.attn_sink.dtype == torch.float32
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for T, K in ((5, 3), (9, 4), (13, 7)):
        x, idx = _inputs(T, K, dim, dtype, device)
        y_e, lse_e, g_e = _step(model, model, x, idx)
        y_c, lse_c, g_c = _step(compiled, model, x, idx)
        assert y_c.shape == (T, dim) and lse_c.shape == (T, n_heads)
        assert y_c.dtype == dtype and lse_c.dtype == torch.float32
        assert relerr(y_c, y_e) < tol, (T, K)
        assert relerr(lse_c, lse_e) < tol, (T, K)
        names = {"wq.weight", "wq.bias", "wkv.weight", "wkv.bias", "attn_sink", "wo.weight", "wo.bias"}
        assert g_c.keys() == g_e.keys() == names
        for name in g_e:
            assert relerr(g_c[name], g_e[name]) < tol, (T, K, name)
        frames.append(counter.frame_count)
    # One graph for all three (T, K). (frame_count counts backend calls: dynamo may call the
    # backend twice for the first graph when it restarts the analysis to specialize the float
    # scale, so what must hold is that later T, K add nothing.)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert frames[0] >= 1 and frames[1] == frames[0] and frames[2] == frames[0], f"recompiled: {frames}"


def test_compiled_with_default_scale_and_no_sink():
    """Leaving attn_sink / scale at None (the common call) must trace too.

    (The dispatcher drops trailing arguments equal to their defaults before it calls the
    fake kernel, which therefore needs the defaults itself.)
    """
    torch._dynamo.reset()
    torch.manual_seed(1)
    q, kv = torch.randn(5, H, D), torch.randn(6, D)
    idx = torch.randint(-1, 7, (5, 3))

    def f(q, kv, idx):
        return torch.ops.dsv4.sparse_mla(q, kv, idx)

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, kv, idx)
    want = f(q, kv, idx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("sink", [True, False])
def test_compiled_fwd_then_bwd(sink):
    torch._dynamo.reset()
    torch.manual_seed(2)
    T, N, K = 6, 7, 5
    q, kv = torch.randn(T, H, D), torch.randn(N, D)
    s = torch.randn(H) if sink else None
    idx = torch.randint(-1, N + 1, (T, K), dtype=torch.int64)
    do, dlse = torch.randn(T, H, D), torch.randn(T, H)
    scale = 0.3

    def f(q, kv, idx, s, do, dlse):
        out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, s, scale)
        dq, dkv, ds = torch.ops.dsv4.sparse_mla_bwd(do, dlse, q, kv, out, lse, idx, s, scale)
        return out * 2, lse + 1, dq, dkv, ds

    counter = CompileCounterWithBackend("inductor")
    got = torch.compile(f, backend=counter, fullgraph=True)(q, kv, idx, s, do, dlse)
    want = f(q, kv, idx, s, do, dlse)
    assert counter.frame_count == 1
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert relerr(g, w) < 1e-6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_topk_length_and_d_v_compile_once_with_dynamic_shapes(device):
    """fullgraph with dynamic shapes: new lengths and a new T recompile nothing; forward and
    gradients (through out and lse) equal eager. d_v < D (the V3.2 layout's shape on CUDA:
    64 score-only columns, which the Triton kernels take)."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    Dk = 16 if device == "cpu" else 192
    d_v = 12 if device == "cpu" else 128
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    N, K = 20, 9

    def f(q, kv, idx, length):
        out, lse = torch.ops.dsv4.sparse_mla(q, kv, idx, None, None, length, d_v)
        return out.float().square().sum() + lse.sum()

    counter = CompileCounterWithBackend("inductor")
    cf = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for T in (7, 7, 11):
        q = torch.randn(T, H, Dk, device=device).to(dtype).requires_grad_()
        kv = torch.randn(N, Dk, device=device).to(dtype).requires_grad_()
        idx = torch.randint(-1, N, (T, K), dtype=torch.int32, device=device)
        length = torch.randint(-1, K + 3, (T,), dtype=torch.int32, device=device)
        got = torch.autograd.grad(cf(q, kv, idx, length), (q, kv))
        want = torch.autograd.grad(f(q, kv, idx, length), (q, kv))
        for g, w in zip(got, want):
            assert relerr(g, w) < (1e-5 if device == "cpu" else 2e-2)
    assert counter.frame_count == 1
