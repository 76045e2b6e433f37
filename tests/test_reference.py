"""The CPU ops (the exact chunked reference) against an independent float64 loop oracle.

The oracle below is written from docs/design.md#the-operation only: per token, per head, an
explicit Python loop over the slots on float64 scalars, with gradients from autograd
through that loop (so the backward formulas of reference.py are not reused either).
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import dsv4_sparse_attn  # noqa: F401  (registers torch.ops.dsv4.*)
from dsv4_sparse_attn import reference
from helpers import relerr

F64 = torch.float64
BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
FWD = torch.ops.dsv4.sparse_mla_fwd
BWD = torch.ops.dsv4.sparse_mla_bwd


def seed_for(*params) -> None:
    """A different seed per parametrized case (fresh data across cases, reproducible per case)."""
    torch.manual_seed(zlib.crc32(repr(params).encode()))


# --------------------------------------------------------------------------- the oracle
def loop_attention(q, kv, idx, sink, scale):
    """float64 (out [T,H,D], lse [T,H]) by explicit loops; differentiable in q, kv, sink."""
    T, H, D = q.shape
    N = kv.shape[0]
    outs, lses = [], []
    for t in range(T):
        valid = [i for i in idx[t].tolist() if 0 <= i < N]  # duplicates kept, in order
        for h in range(H):
            logits = [scale * torch.dot(q[t, h], kv[i]) for i in valid]
            terms = logits + ([sink[h]] if sink is not None else [])
            if not terms:
                outs.append(torch.zeros(D, dtype=F64))
                lses.append(torch.tensor(-math.inf, dtype=F64))
                continue
            m = max(float(x.detach()) for x in terms)  # a constant shift, for range only
            lse = m + torch.log(sum(torch.exp(x - m) for x in terms))
            o = torch.zeros(D, dtype=F64)
            for s_j, i in zip(logits, valid):
                o = o + torch.exp(s_j - lse) * kv[i]
            outs.append(o)
            lses.append(lse)
    out = torch.stack(outs).view(T, H, D) if outs else torch.zeros(T, H, D, dtype=F64)
    lse = torch.stack(lses).view(T, H) if lses else torch.zeros(T, H, dtype=F64)
    return out, lse


def oracle(q, kv, idx, sink, scale, grad_out, grad_lse):
    """Loop oracle on the float64 upcast of the given (possibly bf16-rounded) values.

    Returns out, lse, grad_q, grad_kv ([N, D]), grad_sink (None without sink).
    """
    q64 = q.detach().to(F64).requires_grad_(True)
    kv64 = kv.detach().reshape(kv.shape[0], -1).to(F64).requires_grad_(True)
    s64 = None if sink is None else sink.detach().to(F64).requires_grad_(True)
    out, lse = loop_attention(q64, kv64, idx, s64, scale)
    fin = torch.isfinite(lse)
    loss = (out * grad_out.detach().to(F64)).sum()
    if grad_lse is not None:
        loss = loss + torch.where(fin, lse, torch.zeros_like(lse)).mul(grad_lse.to(F64)).sum()
    leaves = [q64, kv64] + ([s64] if s64 is not None else [])
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    else:  # nothing reaches the loss (K = 0 and no sink)
        grads = [torch.zeros_like(x) for x in leaves]
    gs = grads[2] if s64 is not None else None
    return out.detach(), lse.detach(), grads[0], grads[1], gs


# --------------------------------------------------------------------------- inputs
def special_indices(T, K, N, idx_dtype):
    """Random ids in [0, N) with, in the first rows: an all-masked row, duplicates, extremes."""
    big = 2**31 - 1 if idx_dtype == torch.int32 else 2**40
    neg = -(2**31) if idx_dtype == torch.int32 else -(2**40)
    idx = torch.randint(0, N, (T, K), dtype=torch.int64)
    masked = [-1, N, big, neg, N + 1, -2]
    if T >= 1:
        idx[0] = torch.tensor([masked[j % len(masked)] for j in range(K)])  # empty row
    if T >= 2 and K >= 4:
        a, b = torch.randint(0, N, (2,)).tolist()
        idx[1, :4] = torch.tensor([a, a, a, b])  # duplicates count with multiplicity
    if T >= 3 and K >= 4:
        idx[2, 0], idx[2, 1], idx[2, 3] = -1, big, neg
    if T >= 4 and K >= 2:
        idx[3, -1] = N  # just past the end
        idx[3, -2] = N - 1  # the last valid row
    return idx.to(idx_dtype)


def make(T, H, D, N, K, dtype, sink, idx_dtype, sink_value=None):
    q = torch.randn(T, H, D).to(dtype)
    kv = torch.randn(N, D).to(dtype)
    idx = special_indices(T, K, N, idx_dtype)
    s = None
    if sink:
        s = torch.randn(H) if sink_value is None else torch.full((H,), float(sink_value))
    do = torch.randn(T, H, D).to(dtype)
    dlse = torch.randn(T, H)
    return q, kv, idx, s, do, dlse


def run_ops(q, kv, idx, s, scale, do, dlse):
    out, lse = FWD(q, kv, idx, s, scale)
    dq, dkv, ds = BWD(do, dlse, q, kv, out, lse, idx, s, scale)
    return out, lse, dq, dkv, ds


def check_against_oracle(q, kv, idx, s, scale, do, dlse, bound):
    scale_v = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse, dq, dkv, ds = run_ops(q, kv, idx, s, scale, do, dlse)
    r_out, r_lse, r_dq, r_dkv, r_ds = oracle(q, kv, idx, s, scale_v, do, dlse)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert dq.dtype == q.dtype and dkv.dtype == kv.dtype and dkv.shape == kv.shape
    errs = {
        "out": relerr(out, r_out),
        "lse": relerr(lse, r_lse),
        "grad_q": relerr(dq, r_dq),
        "grad_kv": relerr(dkv.reshape(r_dkv.shape), r_dkv),
    }
    if s is not None:
        assert ds.shape == s.shape and ds.dtype == s.dtype
        errs["grad_sink"] = relerr(ds, r_ds)
    else:
        assert ds.numel() == 0
    bad = {k: v for k, v in errs.items() if not v < bound}
    assert not bad, f"relerr over {bound}: {bad} (all: {errs})"
    return out, lse, dq, dkv, ds


# --------------------------------------------------------------------------- vs the oracle
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_oracle(dtype, sink, idx_dtype):
    seed_for("oracle", dtype, sink, idx_dtype)
    T, H, D, N, K = 6, 3, 16, 9, 7
    q, kv, idx, s, do, dlse = make(T, H, D, N, K, dtype, sink, idx_dtype)
    check_against_oracle(q, kv, idx, s, None, do, dlse, BOUND[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_oracle_without_grad_lse_and_explicit_scale(dtype):
    seed_for("nolse", dtype)
    q, kv, idx, s, do, _ = make(5, 2, 8, 6, 5, dtype, True, torch.int32)
    check_against_oracle(q, kv, idx, s, 0.37, do, None, BOUND[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_structured_indices(dtype):
    from helpers import deepseek_indices

    seed_for("deepseek", dtype)
    T, H, D, K, window, pool = 10, 2, 16, 7, 4, 5
    q, kv, _, s, do, dlse = make(T, H, D, T + pool, K, dtype, True, torch.int32)
    idx = deepseek_indices(T, K, window=window, n_pool=pool)
    check_against_oracle(q, kv, idx, s, None, do, dlse, BOUND[dtype])


@pytest.mark.parametrize("sink_value", [30.0, -30.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_sink(dtype, sink_value):
    seed_for("sink", dtype, sink_value)
    q, kv, idx, s, do, dlse = make(5, 3, 8, 6, 5, dtype, True, torch.int64, sink_value=sink_value)
    out, lse, dq, dkv, ds = check_against_oracle(q, kv, idx, s, None, do, dlse, BOUND[dtype])
    for x in (out, lse, dq, dkv, ds):
        assert torch.isfinite(x.float()).all()


@pytest.mark.parametrize(
    "T,H,D,N,K",
    [(1, 1, 8, 3, 1), (1, 4, 16, 5, 3), (6, 1, 8, 4, 1), (3, 2, 4, 1, 5), (2, 5, 8, 12, 11)],
)
def test_small_shapes(T, H, D, N, K):
    seed_for("small", T, H, D, N, K)
    q, kv, _, s, do, dlse = make(T, H, D, N, K, torch.float32, True, torch.int32)
    idx = torch.randint(-1, N + 1, (T, K), dtype=torch.int32)
    check_against_oracle(q, kv, idx, s, None, do, dlse, BOUND[torch.float32])
    check_against_oracle(q, kv, idx, None, None, do, dlse, BOUND[torch.float32])


# --------------------------------------------------------------------------- masking semantics
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_rows(dtype, sink, idx_dtype):
    seed_for("empty", dtype, sink, idx_dtype)
    T, H, D, N, K = 4, 3, 8, 5, 6
    q, kv, _, s, do, dlse = make(T, H, D, N, K, dtype, sink, idx_dtype)
    info = torch.iinfo(idx_dtype)
    idx = torch.randint(0, N, (T, K), dtype=idx_dtype)
    empty = [0, 2]
    idx[0] = torch.tensor([-1, N, info.max, info.min, -7, N + 3][:K], dtype=idx_dtype)
    idx[2] = -1
    out, lse, dq, dkv, ds = run_ops(q, kv, idx, s, None, do, dlse)
    for x in (out, dq, dkv) + ((lse, ds) if sink else ()):
        assert not torch.isnan(x.float()).any()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    want = s[None].expand(len(empty), H) if sink else torch.full((len(empty), H), -math.inf)
    assert torch.equal(lse[empty], want)
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    # the non-empty rows are still right (against the oracle) and the empty ones add nothing to dkv
    check_against_oracle(q, kv, idx, s, None, do, dlse, BOUND[dtype])
    _, _, _, dkv_only, _ = run_ops(q[[1, 3]], kv, idx[[1, 3]], s, None, do[[1, 3]], dlse[[1, 3]])
    assert relerr(dkv, dkv_only) < 1e-6
    if sink:
        # An empty row has lse = sink exactly, so d lse / d sink = 1: it contributes +grad_lse.
        _, _, _, _, ds_rest = run_ops(q[[1, 3]], kv, idx[[1, 3]], s, None, do[[1, 3]], dlse[[1, 3]])
        assert relerr(ds, ds_rest + dlse[empty].sum(0)) < 1e-5


@pytest.mark.parametrize("sink", [True, False])
def test_duplicates_count_with_multiplicity(sink):
    seed_for("dup", sink)
    H, D, N = 3, 8, 4
    q, kv = torch.randn(1, H, D), torch.randn(N, D)
    s = torch.randn(H) if sink else None
    a, m = 2, 3
    idx = torch.tensor([[a] * m + [-1, N]], dtype=torch.int32)
    out, lse = FWD(q, kv, idx, s, None)
    logit = (q[0] @ kv[a]) * D ** -0.5  # [H]
    den = m * torch.exp(logit.double()) + (torch.exp(s.double()) if sink else 0)
    assert relerr(lse[0], torch.log(den)) < 1e-6
    want = (m * torch.exp(logit.double()) / den)[:, None] * kv[a].double()
    assert relerr(out[0], want) < 1e-6
    # grad_kv of a duplicated row is m times one slot's contribution (vs the loop oracle)
    do, dlse = torch.randn(1, H, D), torch.randn(1, H)
    check_against_oracle(q, kv, idx, s, None, do, dlse, 1e-5)
    _, _, _, dkv, _ = run_ops(q, kv, idx, s, None, do, dlse)
    assert torch.count_nonzero(dkv.abs().sum(-1)).item() == 1 and dkv[a].abs().sum() > 0


def test_ids_equal_to_n_and_above_read_nothing():
    """Ids >= N must be masked, not clamped: changing kv's last row changes nothing else."""
    seed_for("oob")
    T, H, D, N = 3, 2, 8, 5
    q, kv = torch.randn(T, H, D), torch.randn(N, D)
    idx = torch.tensor([[0, 1, N], [2, N + 1, 2**31 - 1], [3, -1, N - 1]], dtype=torch.int32)
    out, lse = FWD(q, kv, idx, None, None)
    ref, ref_lse = FWD(q, kv, idx.clone().masked_fill_(idx >= N, -1), None, None)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


# --------------------------------------------------------------------------- layouts and dtypes
@pytest.mark.parametrize("sink", [True, False])
def test_non_contiguous_inputs(sink):
    seed_for("noncontig", sink)
    T, H, D, N, K = 5, 3, 8, 7, 6
    q = torch.randn(H, T, D).transpose(0, 1)  # [T, H, D], not contiguous
    kv = torch.randn(N, 2 * D)[:, ::2]  # [N, D], stride 2
    idx = torch.randint(-1, N + 1, (K, T), dtype=torch.int32).t()  # [T, K] transposed
    s = torch.randn(2 * H)[::2] if sink else None
    do = torch.randn(T, D, H).transpose(1, 2)
    dlse = torch.randn(H, T).t()
    for x in (q, kv, idx, do, dlse) + ((s,) if sink else ()):
        assert not x.is_contiguous()
    got = run_ops(q, kv, idx, s, None, do, dlse)
    c = lambda x: None if x is None else x.contiguous()  # noqa: E731
    want = run_ops(c(q), c(kv), c(idx), c(s), None, c(do), c(dlse))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert relerr(g, w) < 1e-6
    assert got[2].is_contiguous() and got[0].is_contiguous()


def test_kv_with_singleton_head_dim():
    seed_for("kv3d")
    T, H, D, N, K = 4, 2, 8, 6, 5
    q, kv2, idx, s, do, dlse = make(T, H, D, N, K, torch.float32, True, torch.int64)
    kv3 = torch.randn(N, 3, D)[:, 1:2]  # [N, 1, D], a non-contiguous view
    kv3.copy_(kv2[:, None])
    out3, lse3, dq3, dkv3, ds3 = run_ops(q, kv3, idx, s, None, do, dlse)
    out2, lse2, dq2, dkv2, ds2 = run_ops(q, kv2, idx, s, None, do, dlse)
    assert dkv3.shape == (N, 1, D)
    for a, b in ((out3, out2), (lse3, lse2), (dq3, dq2), (dkv3[:, 0], dkv2), (ds3, ds2)):
        assert relerr(a, b) < 1e-6
    check_against_oracle(q, kv3, idx, s, None, do, dlse, 1e-5)
    # and through autograd
    kvp = kv3.detach().clone().requires_grad_(True)
    o, l_ = torch.ops.dsv4.sparse_mla(q, kvp, idx, s, None)
    ((o * do).sum() + (l_ * dlse).sum()).backward()
    assert kvp.grad.shape == (N, 1, D) and relerr(kvp.grad, dkv3) < 1e-6


@pytest.mark.parametrize("sink", [True, False])
def test_int32_and_int64_indices_agree(sink):
    seed_for("idxdtype", sink)
    q, kv, idx, s, do, dlse = make(5, 2, 8, 6, 5, torch.float32, sink, torch.int64)
    a = run_ops(q, kv, idx, s, None, do, dlse)
    b = run_ops(q, kv, idx.clamp(-(2**31), 2**31 - 1).to(torch.int32), s, None, do, dlse)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("sink", [True, False])
def test_zero_tokens(sink):
    H, D, N, K = 3, 8, 4, 5
    q, kv = torch.randn(0, H, D), torch.randn(N, D)
    idx = torch.zeros(0, K, dtype=torch.int32)
    s = torch.randn(H) if sink else None
    out, lse = FWD(q, kv, idx, s, None)
    assert out.shape == (0, H, D) and lse.shape == (0, H)
    dq, dkv, ds = BWD(torch.randn(0, H, D), torch.randn(0, H), q, kv, out, lse, idx, s, None)
    assert dq.shape == (0, H, D) and dkv.shape == (N, D)
    assert torch.equal(dkv, torch.zeros_like(dkv))
    assert ds.shape == ((H,) if sink else (0,))
    if sink:
        assert torch.equal(ds, torch.zeros(H))


@pytest.mark.parametrize("sink", [True, False])
def test_zero_slots(sink):
    seed_for("k0", sink)
    T, H, D, N = 3, 2, 8, 4
    q, kv, _, s, do, dlse = make(T, H, D, N, 1, torch.float32, sink, torch.int32)
    idx = torch.zeros(T, 0, dtype=torch.int64)
    out, lse, dq, dkv, ds = run_ops(q, kv, idx, s, None, do, dlse)
    assert out.shape == (T, H, D) and torch.equal(out, torch.zeros_like(out))
    want = s[None].expand(T, H) if sink else torch.full((T, H), -math.inf)
    assert torch.equal(lse, want)
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dkv, torch.zeros_like(dkv))
    if sink:
        assert relerr(ds, dlse.sum(0)) < 1e-6
    check_against_oracle(q, kv, idx, s, None, do, dlse, 1e-5)


# --------------------------------------------------------------------------- autograd
def _autograd_run(op, q, kv, idx, s, scale, do, dlse):
    qq = q.detach().clone().requires_grad_(True)
    kk = kv.detach().clone().requires_grad_(True)
    ss = None if s is None else s.detach().clone().requires_grad_(True)
    out, lse = op(qq, kk, idx, ss, scale)
    fin = torch.isfinite(lse)
    loss = (out.float() * do.float()).sum() + torch.where(fin, lse, 0).mul(dlse).sum()
    loss.backward()
    return out, lse, qq.grad, kk.grad, (None if ss is None else ss.grad)


@pytest.mark.parametrize("op_name", ["sparse_mla", "sparse_mla_fwd"])
@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_matches_oracle(op_name, sink, dtype):
    seed_for("autograd", op_name, sink, dtype)
    op = getattr(torch.ops.dsv4, op_name)
    q, kv, idx, s, do, dlse = make(5, 3, 8, 7, 6, dtype, sink, torch.int32)
    out, lse, dq, dkv, ds = _autograd_run(op, q, kv, idx, s, None, do, dlse)
    r_out, r_lse, r_dq, r_dkv, r_ds = oracle(q, kv, idx, s, 8 ** -0.5, do, dlse)
    b = BOUND[dtype]
    assert relerr(out, r_out) < b and relerr(lse, r_lse) < b
    assert relerr(dq, r_dq) < b and relerr(dkv, r_dkv) < b
    if sink:
        assert ds.dtype == torch.float32 and relerr(ds, r_ds) < b


def _gradcheck_indices(T, K, N, allow_empty):
    idx = torch.randint(0, N, (T, K), dtype=torch.int64)
    idx[0, 1] = idx[0, 0]  # a duplicate
    idx[0, 2] = -1
    idx[1, 0] = N + 3  # out of range
    idx[1, 1] = -(2**40)
    if allow_empty:
        idx[2] = -1  # empty row: fine with a sink (lse = sink, finite)
    return idx


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("op_name", ["sparse_mla", "sparse_mla_fwd"])
def test_gradcheck(op_name, sink, scale):
    seed_for("gradcheck", op_name, sink, scale)
    op = getattr(torch.ops.dsv4, op_name)
    T, H, D, N, K = 4, 2, 4, 5, 4
    q = torch.randn(T, H, D, dtype=F64, requires_grad=True)
    kv = torch.randn(N, D, dtype=F64, requires_grad=True)
    idx = _gradcheck_indices(T, K, N, allow_empty=sink)
    if sink:
        s = torch.randn(H, dtype=F64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda a, b, c: op(a, b, idx, c, scale), (q, kv, s))
    else:
        assert torch.autograd.gradcheck(lambda a, b: op(a, b, idx, None, scale), (q, kv))


def test_double_backward_raises():
    q = torch.randn(2, 2, 4, dtype=F64, requires_grad=True)
    kv = torch.randn(3, 4, dtype=F64, requires_grad=True)
    idx = torch.tensor([[0, 1], [2, -1]])
    out, _ = torch.ops.dsv4.sparse_mla(q, kv, idx, None, None)
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="not differentiable"):
        gq.sum().backward()


# --------------------------------------------------------------------------- chunking
def _spy_chunks(monkeypatch):
    steps = []
    real = reference._chunks

    def spy(T, step):
        steps.append(step)
        return real(T, step)

    monkeypatch.setattr(reference, "_chunks", spy)
    return steps


@pytest.mark.parametrize("tokens_per_chunk", [1, 2])
@pytest.mark.parametrize("sink", [True, False])
def test_chunking_does_not_change_results(monkeypatch, sink, tokens_per_chunk):
    seed_for("chunk", sink, tokens_per_chunk)
    q, kv, idx, s, do, dlse = make(7, 3, 8, 9, 6, torch.float32, sink, torch.int32)
    whole = run_ops(q, kv, idx, s, None, do, dlse)
    steps = _spy_chunks(monkeypatch)
    monkeypatch.setattr(reference, "token_chunk", lambda H, D, K, budget=None: tokens_per_chunk)
    chunked = run_ops(q, kv, idx, s, None, do, dlse)
    assert steps == [tokens_per_chunk, tokens_per_chunk]  # fwd and bwd really were chunked
    for a, b in zip(chunked, whole):
        assert relerr(a, b) < 1e-6


def test_chunk_bytes_is_honoured(monkeypatch):
    seed_for("chunkbytes")
    q, kv, idx, s, do, dlse = make(5, 2, 8, 6, 4, torch.float32, True, torch.int32)
    whole = run_ops(q, kv, idx, s, None, do, dlse)
    steps = _spy_chunks(monkeypatch)
    monkeypatch.setattr(reference, "CHUNK_BYTES", 1)
    chunked = run_ops(q, kv, idx, s, None, do, dlse)
    for a, b in zip(chunked, whole):
        assert relerr(a, b) < 1e-6
    assert steps == [1, 1]


def test_token_chunk_budget():
    T, H, D, K = 65536, 128, 512, 1152
    budget = reference.CHUNK_BYTES
    assert budget == 256 * 2**20
    c = reference.token_chunk(H, D, K)
    assert 0 < c < T
    # what one token's temporaries need at least: bf16 gathered rows, their fp32 copy,
    # three fp32 [K, D] backward products and a few fp32 [H, K] score tensors
    per_token = K * D * (2 + 4 + 3 * 4) + H * K * 4 * 4
    assert c * per_token <= budget
    assert reference.token_chunk(H, D, K, budget=1) == 1
    assert reference.token_chunk(1, 8, 1, budget=2**40) > 0
    assert reference.token_chunk(H, D, 0) > 0  # K = 0 does not divide by zero
