"""The Python API: batched (per-sample ids) vs flat layout, gradients, return_lse, sparse_attn."""
from __future__ import annotations

import zlib

import pytest
import torch

import dsv4_sparse_attn
from dsv4_sparse_attn import sparse_attn, sparse_mla
from helpers import relerr


def seed_for(*params) -> None:
    torch.manual_seed(zlib.crc32(repr(params).encode()))


def batched_inputs(B, S, H, D, N, K, dtype=torch.float32, idx_dtype=torch.int32, sink=True):
    q = torch.randn(B, S, H, D).to(dtype)
    kv = torch.randn(B, N, D).to(dtype)
    idx = torch.randint(-2, N + 3, (B, S, K), dtype=torch.int64)
    big = 2**31 - 1 if idx_dtype == torch.int32 else 2**62
    # sample 0: ids >= N that a naive "b * N + id" would turn into sample 1's rows
    idx[0, 0, :3] = torch.tensor([N, N + 1, 2 * N - 1])
    idx[0, 1, :] = N  # a whole row past the end: empty
    idx[0, 2, 0] = big
    idx[B - 1, 0, -1] = -(2**31) if idx_dtype == torch.int32 else -(2**62)
    idx = idx.to(idx_dtype)
    s = torch.randn(H) if sink else None
    return q, kv, idx, s


def flatten_by_hand(q, kv, idx):
    """Flat inputs with per-sample offsets, written independently of api._flatten_batched."""
    B, S, H, D = q.shape
    N = kv.shape[1]
    rows = []
    for b in range(B):
        for t in range(S):
            rows.append([b * N + i if 0 <= i < N else -1 for i in idx[b, t].tolist()])
    flat_idx = torch.tensor(rows, dtype=torch.int64).view(B * S, -1)
    return q.reshape(B * S, H, D), kv.reshape(B * N, D), flat_idx


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_equals_flat(dtype, sink, idx_dtype):
    seed_for("bf", dtype, sink, idx_dtype)
    B, S, H, D, N, K = 3, 4, 2, 8, 5, 6
    q, kv, idx, s = batched_inputs(B, S, H, D, N, K, dtype, idx_dtype, sink)
    out, lse = sparse_mla(q, kv, idx, s, return_lse=True)
    assert out.shape == (B, S, H, D) and out.dtype == dtype
    assert lse.shape == (B, S, H) and lse.dtype == torch.float32
    fq, fkv, fidx = flatten_by_hand(q, kv, idx)
    fout, flse = sparse_mla(fq, fkv, fidx, s, return_lse=True)
    assert fout.shape == (B * S, H, D) and flse.shape == (B * S, H)
    assert relerr(out.reshape(B * S, H, D), fout) < 1e-6
    assert relerr(lse.reshape(B * S, H), flse) < 1e-6
    # the all-past-the-end row of sample 0 is empty
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    empty_lse = s if sink else torch.full((H,), float("-inf"))
    assert torch.equal(lse[0, 1], empty_lse)


def test_ids_past_the_end_do_not_read_the_next_sample():
    seed_for("leak")
    B, S, H, D, N, K = 2, 3, 2, 8, 4, 5
    q, kv, idx, s = batched_inputs(B, S, H, D, N, K)
    out, lse = sparse_mla(q, kv, idx, s, return_lse=True)
    kv2 = kv.clone()
    kv2[1] = torch.randn(N, D) * 10  # change only sample 1's rows
    out2, lse2 = sparse_mla(q, kv2, idx, s, return_lse=True)
    assert torch.equal(out[0], out2[0]) and torch.equal(lse[0], lse2[0])
    assert not torch.equal(out[1], out2[1])
    # and the ids >= N of sample 0 act exactly like -1
    masked = idx.clone()
    masked[(idx < 0) | (idx >= N)] = -1
    out3, lse3 = sparse_mla(q, kv, masked, s, return_lse=True)
    assert torch.equal(out, out3) and torch.equal(lse, lse3)


@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_gradients_equal_flat(dtype, sink):
    seed_for("bgrad", dtype, sink)
    B, S, H, D, N, K = 2, 3, 3, 8, 5, 6
    q, kv, idx, s = batched_inputs(B, S, H, D, N, K, dtype, torch.int32, sink)
    do = torch.randn(B, S, H, D).to(dtype)
    dlse = torch.randn(B, S, H)

    def grads(q, kv, idx):
        qq = q.detach().clone().requires_grad_(True)
        kk = kv.detach().clone().requires_grad_(True)
        ss = None if s is None else s.detach().clone().requires_grad_(True)
        out, lse = sparse_mla(qq, kk, idx, ss, return_lse=True)
        lse = torch.where(torch.isfinite(lse), lse, 0)
        loss = (out.float() * do.reshape(out.shape).float()).sum() + (lse * dlse.reshape(lse.shape)).sum()
        loss.backward()
        return qq.grad, kk.grad, (None if ss is None else ss.grad)

    gq, gkv, gs = grads(q, kv, idx)
    assert gq.shape == q.shape and gkv.shape == kv.shape
    fq, fkv, fidx = flatten_by_hand(q, kv, idx)
    fgq, fgkv, fgs = grads(fq, fkv, fidx)
    assert relerr(gq.reshape(fgq.shape), fgq) < 1e-6
    assert relerr(gkv.reshape(fgkv.shape), fgkv) < 1e-6
    if sink:
        assert relerr(gs, fgs) < 1e-6


def test_flat_layout_and_return_lse():
    seed_for("flat")
    T, H, D, N, K = 5, 2, 8, 6, 4
    q, kv = torch.randn(T, H, D), torch.randn(N, D)
    idx = torch.randint(-1, N + 1, (T, K), dtype=torch.int32)
    s = torch.randn(H)
    out = sparse_mla(q, kv, idx, s)
    assert isinstance(out, torch.Tensor) and out.shape == (T, H, D)
    out2, lse = sparse_mla(q, kv, idx, s, return_lse=True)
    ref_out, ref_lse = torch.ops.dsv4.sparse_mla(q, kv, idx, s, None)
    assert torch.equal(out, ref_out) and torch.equal(out2, ref_out) and torch.equal(lse, ref_lse)
    # kv as [N, 1, D]
    out3 = sparse_mla(q, kv[:, None], idx, s)
    assert torch.equal(out3, out)
    # explicit scale
    o4, l4 = sparse_mla(q, kv, idx, s, 0.2, return_lse=True)
    r4, rl4 = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, s, 0.2)
    assert torch.equal(o4, r4) and torch.equal(l4, rl4)


@pytest.mark.parametrize("sink", [True, False])
def test_sparse_attn_drop_in(sink):
    seed_for("dropin", sink)
    B, S, H, D, N, K = 2, 3, 2, 8, 5, 4
    q, kv, idx, s = batched_inputs(B, S, H, D, N, K, sink=sink)
    scale = 0.31
    out = sparse_attn(q, kv, s, idx, scale)
    assert isinstance(out, torch.Tensor) and out.shape == (B, S, H, D)
    assert torch.equal(out, sparse_mla(q, kv, idx, s, scale))
    # differentiable
    qq = q.clone().requires_grad_(True)
    ss = None if s is None else s.clone().requires_grad_(True)
    sparse_attn(qq, kv, ss, idx, scale).square().sum().backward()
    assert qq.grad is not None and torch.isfinite(qq.grad).all()
    if sink:
        assert ss.grad is not None and ss.grad.shape == (H,)


def test_batched_q_is_viewed_not_copied(monkeypatch):
    seed_for("view")
    B, S, H, D, N, K = 2, 3, 2, 8, 5, 4
    q, kv, idx, s = batched_inputs(B, S, H, D, N, K)
    seen = []
    real = torch.ops.dsv4.sparse_mla

    def spy(*args, **kwargs):
        seen.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.ops.dsv4, "sparse_mla", spy)
    sparse_mla(q, kv, idx, s)
    assert len(seen) == 1
    fq = seen[0]
    assert fq.shape == (B * S, H, D)
    assert fq.data_ptr() == q.data_ptr()
    assert fq.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()


def test_batched_shape_errors():
    q = torch.randn(2, 3, 2, 8)
    kv = torch.randn(2, 5, 8)
    idx = torch.zeros(2, 3, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"batched kv must have shape \[B, N, D\]"):
        sparse_mla(q, kv[0], idx)
    with pytest.raises(ValueError, match=r"batched indices must have shape \[B, S, K\]"):
        sparse_mla(q, kv, idx[0])
    with pytest.raises(ValueError, match="batched shapes disagree"):
        sparse_mla(q, kv[:1], idx)
    with pytest.raises(ValueError, match="batched shapes disagree"):
        sparse_mla(q, kv, idx[:, :2])
    with pytest.raises(TypeError, match="indices must have dtype int32 or int64"):
        sparse_mla(q, kv, idx.float())
    with pytest.raises(ValueError, match=r"q must have shape \[T, H, D\] \(flat\) or \[B, S, H, D\]"):
        sparse_mla(q[0, 0], kv, idx)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        sparse_mla([1.0], kv, idx)


def test_public_names():
    assert dsv4_sparse_attn.sparse_mla is sparse_mla
    assert dsv4_sparse_attn.sparse_attn is sparse_attn
    assert set(dsv4_sparse_attn.__all__) >= {"sparse_mla", "sparse_attn"}


def naive_sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    """Dense batched softmax over the gathered rows, autograd does the backward.

    Written independently of reference.py: the oracle for the drop-in's gradients.
    Rows must have a valid id or a sink (an all-masked row without sink is NaN here).
    """
    B, S, H, D = q.shape
    N, K = kv.shape[1], topk_idxs.shape[-1]
    valid = (topk_idxs >= 0) & (topk_idxs < N)
    safe = torch.where(valid, topk_idxs, 0).long()
    rows = torch.gather(kv[:, None].expand(B, S, N, D), 2, safe[..., None].expand(B, S, K, D))
    s = torch.einsum("bshd,bskd->bshk", q, rows) * softmax_scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    if attn_sink is not None:
        s = torch.cat([s, attn_sink.view(1, 1, H, 1).expand(B, S, H, 1).to(s.dtype)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :K]
    return torch.einsum("bshk,bskd->bshd", p, rows)


@pytest.mark.parametrize("sink", [True, False])
def test_sparse_attn_gradients_float64(sink):
    """The drop-in through the batched path, in float64: torch.autograd.gradcheck, and
    out and every gradient against the naive dense implementation above."""
    seed_for("dropin64", sink)
    B, S, H, D, N, K = 2, 3, 2, 4, 4, 5
    q = torch.randn(B, S, H, D, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(B, N, D, dtype=torch.float64, requires_grad=True)
    s = torch.randn(H, dtype=torch.float64, requires_grad=True) if sink else None
    idx = torch.randint(-1, N + 2, (B, S, K), dtype=torch.int32)
    idx[0, 0, :2] = torch.tensor([N, N + 1])  # past sample 0's end: masked, not sample 1
    idx[1, 1, 0] = idx[1, 1, 1] = 2          # a duplicate
    idx[:, :, -1] = torch.arange(S).clamp(max=N - 1)  # every row has a valid id
    if sink:
        idx[1, 2] = -1  # an empty row: only the sink
    scale = 0.37
    inputs = (q, kv, s) if sink else (q, kv)

    def f(q, kv, s=None):
        return sparse_attn(q, kv, s, idx, scale)

    assert torch.autograd.gradcheck(f, inputs)
    out = f(*inputs)
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    want = naive_sparse_attn(leaves[0], leaves[1], leaves[2] if sink else None, idx, scale)
    assert relerr(out, want) < 1e-12
    do = torch.randn_like(out)
    got_g = torch.autograd.grad(out, inputs, do)
    want_g = torch.autograd.grad(want, leaves, do)
    for g, w in zip(got_g, want_g):
        assert g.dtype == torch.float64 and relerr(g, w) < 1e-12
