"""SparseMLAAttention: layouts, the sink's dtype, gradients against float64 (CPU)."""
from __future__ import annotations

import pytest
import torch

from dsv4_sparse_attn import SparseMLAAttention, sparse_mla
from helpers import relerr

DIM, H, D = 12, 3, 8


def _block(seed=0, **kw):
    torch.manual_seed(seed)
    block = SparseMLAAttention(DIM, H, D, **kw)
    with torch.no_grad():
        block.attn_sink.normal_()
    return block


def test_flat_shapes_and_parameters():
    block = _block()
    assert {n: tuple(p.shape) for n, p in block.named_parameters()} == {
        "wq.weight": (H * D, DIM), "wkv.weight": (D, DIM), "attn_sink": (H,), "wo.weight": (DIM, H * D)}
    assert block.attn_sink.dtype == torch.float32
    assert block.scale == D ** -0.5
    x, idx = torch.randn(7, DIM), torch.randint(-1, 8, (7, 4))
    y, lse = block(x, idx, return_lse=True)
    assert y.shape == (7, DIM) and lse.shape == (7, H) and lse.dtype == torch.float32
    assert torch.equal(block(x, idx), y)
    # the block is exactly: projections around the op
    q = block.wq(x).view(7, H, D)
    out, lse2 = torch.ops.dsv4.sparse_mla(q, block.wkv(x), idx, block.attn_sink, D ** -0.5)
    assert torch.equal(block.wo(out.flatten(1)), y) and torch.equal(lse2, lse)
    assert "n_heads=3" in repr(block)


def test_batched_equals_flat_per_sample():
    block = _block(1, bias=True, scale=0.2)
    assert block.scale == 0.2 and block.wq.bias is not None
    B, S, K = 3, 5, 4
    x, idx = torch.randn(B, S, DIM), torch.randint(-1, S + 2, (B, S, K))
    y, lse = block(x, idx, return_lse=True)
    assert y.shape == (B, S, DIM) and lse.shape == (B, S, H)
    for b in range(B):  # sample b alone, flat: ids >= S are masked, never read sample b + 1
        yb, lb = block(x[b], idx[b], return_lse=True)
        assert relerr(y[b], yb) < 1e-6 and relerr(lse[b], lb) < 1e-6


def test_gradients_match_float64():
    """Every parameter gradient (and x's) of the fp32 block against the float64 block."""
    block = _block(2, bias=True)
    block64 = _block(2, bias=True).double()
    assert block64.attn_sink.dtype == torch.float64  # cast like every parameter
    x, idx = torch.randn(2, 6, DIM), torch.randint(-1, 7, (2, 6, 5))
    grads = []
    for m, xx in ((block, x.clone()), (block64, x.double())):
        xx.requires_grad_(True)
        y, lse = m(xx, idx, return_lse=True)
        (y.square().sum() + lse.sum()).backward()
        grads.append({"x": xx.grad, **{n: p.grad for n, p in m.named_parameters()}})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert grads[0][name].dtype == torch.float32
        assert relerr(grads[0][name], grads[1][name]) < 1e-5, name


def test_gradcheck_float64():
    block = _block(3).double()
    x = torch.randn(5, DIM, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(-1, 6, (5, 3))
    params = tuple(block.parameters())

    names = [n for n, _ in block.named_parameters()]

    def f(x, *ps):
        return torch.func.functional_call(block, dict(zip(names, ps)), (x, idx, True))

    assert torch.autograd.gradcheck(f, (x, *params))


def test_cast_module_sink_dtype():
    """.to(bfloat16) casts the sink too; forward still hands the op an fp32 sink and the
    sink's gradient arrives in bfloat16."""
    block = _block(4).to(torch.bfloat16)
    assert block.attn_sink.dtype == torch.bfloat16 and block.wq.weight.dtype == torch.bfloat16
    x, idx = torch.randn(6, DIM, dtype=torch.bfloat16), torch.randint(-1, 7, (6, 4))
    y, lse = block(x, idx, return_lse=True)
    assert y.dtype == torch.bfloat16 and lse.dtype == torch.float32
    (y.float().square().sum() + lse.sum()).backward()
    assert block.attn_sink.grad.dtype == torch.bfloat16 and torch.isfinite(block.attn_sink.grad).all()


def test_sink_is_created_fp32_under_bf16_default_dtype():
    """As in DeepSeek's reference model: built under a bf16 default dtype, the sink stays fp32."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        block = SparseMLAAttention(DIM, H, D)
    finally:
        torch.set_default_dtype(old)
    assert block.wq.weight.dtype == torch.bfloat16 and block.attn_sink.dtype == torch.float32
    block2 = SparseMLAAttention(DIM, H, D, dtype=torch.bfloat16)
    assert block2.wkv.weight.dtype == torch.bfloat16 and block2.attn_sink.dtype == torch.float32
    x, idx = torch.randn(4, DIM, dtype=torch.bfloat16), torch.randint(-1, 5, (4, 2))
    block(x, idx).float().sum().backward()
    assert block.attn_sink.grad.dtype == torch.float32


def test_autocast_bf16():
    """fp32 parameters under autocast: q and kv come out of the projections in bf16."""
    block = _block(5)
    x, idx = torch.randn(6, DIM), torch.randint(-1, 7, (6, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, lse = block(x, idx, return_lse=True)
    assert y.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref = block(x, idx)
    assert relerr(y, ref) < 3e-2
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in block.parameters())


def test_uses_the_batched_api():
    """Batched x goes through sparse_mla's per-sample layout (same as calling it directly)."""
    block = _block(6)
    x, idx = torch.randn(2, 4, DIM), torch.randint(-1, 6, (2, 4, 3))
    q = block.wq(x).view(2, 4, H, D)
    out = sparse_mla(q, block.wkv(x), idx, block.attn_sink, block.scale)
    assert torch.equal(block.wo(out.flatten(-2)), block(x, idx))


def test_bad_input_shape():
    block = _block()
    with pytest.raises(ValueError, match=r"x must have shape \[T, 12\] or \[B, S, 12\]"):
        block(torch.randn(4, DIM + 1), torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"x must have shape"):
        block(torch.randn(DIM), torch.zeros(1, 2, dtype=torch.int32))
