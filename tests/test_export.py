"""torch.export and AOTInductor of models that call the dsv4 ops: CPU, and CUDA where present.

What deployment needs from a custom op, checked here as FlashAttention-3's tests check
it for theirs:

* ``torch.export.export`` traces ``SparseMLAAttention`` with a dynamic token count T
  (``torch.export.Dim``): the op's fake kernel must propagate a symbolic T without
  specialising it, so one exported program runs at every T in the declared range. The
  op must stay one opaque node, ``dsv4.sparse_mla.default``, also after
  ``run_decompositions()`` (the inference IR that AOTInductor lowers), and survive
  ``torch.export.save`` / ``load`` (ops serialise by name).
* ``torch._inductor.aoti_compile_and_package`` turns the exported block into a
  ``.pt2`` package (C++ compiled by the host compiler); ``aoti_load_package`` runs it.
  The package calls the op through the dispatcher, so the registered kernel runs: the
  PyTorch reference on the CPU, the Triton / Gluon kernels on the GPU.

Each is compared with the eager module at two T other than the one traced (an
exported program specialised to the traced T would reject them): T=1 (a single token,
the smallest the Dim allows) and a larger, odd T.

CPU: fp32, small dims, the reference. GPU (skipped without one): bf16 with D=512 and
H=64, the DeepSeek-V4 shape, so the Gluon forward and backward kernels run on sm_90 (the
Triton ones elsewhere).
"""
from __future__ import annotations

import io
import time

import pytest
import torch
import torch._inductor
from torch.export import Dim

import dsv4_sparse_attn  # noqa: F401  (registers torch.ops.dsv4.*)
from dsv4_sparse_attn import SparseMLAAttention, reference
from dsv4_sparse_attn.kernels import dispatch
from helpers import causal_indices, make_inputs, relerr

OP = torch.ops.dsv4.sparse_mla.default

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16, D=512: the Triton / Gluon kernels)")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]

# Per device: (dim, H, D, K, window, dtype, T traced, T run, tolerance exported, tolerance AOTI),
# tolerances on relerr against the eager module.
# Exported program: the same ATen ops and the same dsv4 kernel on the same shapes as eager;
# observed bitwise equal (relerr 0: CPU, and an H200 with torch 2.11, for y, lse and all
# gradients); 1e-6 leaves room for a library picking another summation order.
# AOTInductor: observed bitwise equal too (CPU; H200), but inductor may replace the
# projections' GEMMs by its own kernels and keep fp32 where eager rounds to the input
# dtype: CPU fp32, 1e-5 allows fp32 reassociation; GPU bf16, the allowance of
# tests/test_compile.py (inductor against eager, bf16), 2e-2, one or two bf16 roundings
# (2^-8). A wrong result is off by O(1).
CONFIGS = {
    "cpu": (64, 4, 32, 8, 4, torch.float32, 16, (1, 37), 1e-6, 1e-5),
    "cuda": (512, 64, 512, 64, 32, torch.bfloat16, 128, (1, 301), 1e-6, 2e-2),
}
T_MAX = 4096  # the upper end of the dynamic T: any bound works; it goes into the program


def _block(device: str) -> SparseMLAAttention:
    dim, n_heads, head_dim, _, _, dtype = CONFIGS[device][:6]
    torch.manual_seed(0)
    # dtype= keeps the sink fp32 (it is created so), as a bf16 model built this way has.
    model = SparseMLAAttention(dim, n_heads, head_dim, device=device, dtype=dtype)
    with torch.no_grad():
        model.attn_sink.normal_()  # a sink that matters (it is created as zeros)
    return model


def _inputs(device: str, T: int, seed: int):
    dim, _, _, K, window, dtype = CONFIGS[device][:6]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, dim, generator=g).to(device=device, dtype=dtype)
    idx = causal_indices((T,), K, window, generator=g).to(device)
    return x, idx


def _export_block(model: SparseMLAAttention, device: str) -> torch.export.ExportedProgram:
    """The block, traced at T = CONFIGS' traced T with ``return_lse=True``, T dynamic."""
    T = Dim("T", min=1, max=T_MAX)
    x, idx = _inputs(device, CONFIGS[device][6], seed=0)
    return torch.export.export(
        model, (x, idx), {"return_lse": True},
        dynamic_shapes={"x": {0: T}, "indices": {0: T}, "return_lse": None},
    )


def _op_nodes(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is OP]


def _count_op_calls(monkeypatch, device: str) -> list:
    """Count calls of the implementation ops.py runs for ``device`` (module attributes, as
    ops.py looks them up): a list that grows by one per call of the op."""
    mod, name = (reference, "sparse_mla_fwd") if device == "cpu" else (dispatch, "forward")
    real, calls = getattr(mod, name), []

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, name, spy)
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_export_block_dynamic_T(device):
    """The exported block: one dsv4 op node (also in the inference IR), and at two new T
    the same y, lse and gradients (x and every parameter) as eager.

    The gradients check that the training IR keeps the op's registered autograd: the
    program's module is differentiable like the eager one.
    """
    model = _block(device)
    ep = _export_block(model, device)
    assert len(_op_nodes(ep.graph_module)) == 1, ep.graph
    assert len(_op_nodes(ep.run_decompositions().graph_module)) == 1  # not decomposed
    # T is one symbol with the declared range, not a constant.
    assert [(r.lower, r.upper) for r in ep.range_constraints.values()] == [(1, T_MAX)]

    tol = CONFIGS[device][8]
    exported = ep.module()
    # The same gradients, bit for bit: the deterministic backward (the fast one's fp32
    # atomics change the last bits of grad_kv from run to run, and so grad_x and grad_wkv).
    dsv4_sparse_attn.set_deterministic_backward(True)
    try:
        _compare_exported_with_eager(exported, model, device, tol)
    finally:
        dsv4_sparse_attn.set_deterministic_backward(None)


def _compare_exported_with_eager(exported, model, device, tol):
    for seed, T in enumerate(CONFIGS[device][7], start=1):
        x, idx = _inputs(device, T, seed)
        x.requires_grad_(True)
        results = []
        for fn in (exported, model):
            y, lse = fn(x, idx, return_lse=True)
            assert y.shape == x.shape and lse.shape == (T, model.n_heads)
            params = [p for _, p in sorted(fn.named_parameters())]
            loss = y.float().square().mean() + 0.1 * lse.mean()
            grads = torch.autograd.grad(loss, [x, *params])
            results.append((y, lse, grads))
        (y_e, lse_e, g_e), (y, lse, g) = results[1], results[0]
        assert y.dtype == y_e.dtype and lse.dtype == torch.float32
        assert relerr(y, y_e) < tol, (T, relerr(y, y_e))
        assert relerr(lse, lse_e) < tol, (T, relerr(lse, lse_e))
        assert len(g) == len(g_e) == 1 + 4  # x, attn_sink, wkv, wo, wq
        for i, (a, b) in enumerate(zip(g, g_e)):
            assert relerr(a, b) < tol, (T, i, relerr(a, b))


@pytest.mark.parametrize("sink", [True, False], ids=["sink", "no_sink"])
def test_export_op_directly(sink):
    """A function calling ``torch.ops.dsv4.sparse_mla`` itself, T, N and K dynamic: after
    ``run_decompositions()`` the graph is the op and the two getitems of its outputs,
    nothing else (no reference ops inlined); the program and its save/load round trip
    give the eager op's results, bitwise (the same kernel on the same inputs).

    Without a sink the op is called with attn_sink and scale left to their defaults: the
    fake kernel then gets fewer arguments (the dispatcher drops trailing defaults).
    """

    class Attn(torch.nn.Module):
        def forward(self, q, kv, idx, s):
            if s is None:
                return torch.ops.dsv4.sparse_mla(q, kv, idx)
            return torch.ops.dsv4.sparse_mla(q, kv, idx, s, 0.3)

    H, D = 4, 32
    T, N, K = Dim("T", min=1), Dim("N", min=1), Dim("K", min=1)
    torch.manual_seed(0)
    q, kv, idx, s = make_inputs(12, H, D, 20, 8, sink=sink)
    ep = torch.export.export(Attn(), (q, kv, idx, s),
                             dynamic_shapes=({0: T}, {0: N}, {0: T, 1: K}, None))
    ep = ep.run_decompositions()
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(OP) == 1 and all(t is OP or t.__name__ == "getitem" for t in targets), targets
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)

    for T_, N_, K_ in ((1, 3, 2), (29, 50, 13)):
        q, kv, idx, s = make_inputs(T_, H, D, N_, K_, sink=sink)
        want = Attn()(q, kv, idx, s)
        for prog in (ep, loaded):
            got = prog.module()(q, kv, idx, s)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (T_, N_, K_)


@pytest.mark.parametrize("device", DEVICES)
def test_aoti_package_block(device, tmp_path, monkeypatch):
    """The exported block compiled by AOTInductor into a .pt2 package and loaded back:
    at two new T, y and lse match eager, and each run calls the op's kernel once (the
    package calls the dsv4 op through the dispatcher; nothing inlined or skipped).

    Time (torch 2.13, 2 CPU cores): about 16 s with an empty inductor cache (mostly g++
    on the wrapper), 8 s with a warm one: not marked slow. CUDA: 56 s on an H200 machine
    (torch 2.11), mostly the host compiler.
    """
    model = _block(device)
    ep = _export_block(model, device)
    t0 = time.perf_counter()
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "block.pt2"))
    print(f"aoti_compile_and_package ({device}): {time.perf_counter() - t0:.1f} s")
    runner = torch._inductor.aoti_load_package(path)

    tol = CONFIGS[device][9]
    for seed, T in enumerate(CONFIGS[device][7], start=1):
        x, idx = _inputs(device, T, seed)
        with torch.no_grad():
            y_e, lse_e = model(x, idx, return_lse=True)
            calls = _count_op_calls(monkeypatch, device)
            y, lse = runner(x, idx, return_lse=True)
            monkeypatch.undo()
        assert len(calls) == 1, len(calls)
        assert y.shape == x.shape and y.dtype == x.dtype, (y.shape, y.dtype)
        assert lse.shape == (T, model.n_heads) and lse.dtype == torch.float32
        assert relerr(y, y_e) < tol, (T, relerr(y, y_e))
        assert relerr(lse, lse_e) < tol, (T, relerr(lse, lse_e))
