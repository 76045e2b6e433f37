"""Non-finite values and degenerate shapes in the CPU reference (the op's CPU kernel and
every test's oracle): masked slots contribute exactly nothing, a sink's IEEE value reaches
only its own head, N = 0 works, and a scale that is not a usable fp32 number is refused."""
import math

import pytest
import torch

import dsv4_sparse_attn

D, H = 16, 3


def _fwd_bwd(q, kv, idx, sink, scale=None):
    """out, lse and the gradients of (out * w).sum() + lse.sum() through the op (CPU: the
    reference), float64."""
    q, kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    s = None if sink is None else sink.clone().requires_grad_()
    out, lse = torch.ops.dsv4.sparse_mla(q, kv, idx, s, scale)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    (out * w).sum().add(lse.nan_to_num(posinf=0.0, neginf=0.0).sum()).backward()
    return out, lse, q.grad, kv.grad, (None if s is None else s.grad)


def _inputs(T=5, N=7, K=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(N, D, generator=g, dtype=torch.float64)
    idx = torch.randint(1, N, (T, K), generator=g)
    idx[:, 0] = -1  # a masked slot in every token
    idx[:, 1] = N + 3
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    return q, kv, idx, sink


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_row_no_token_selects_changes_nothing(bad):
    q, kv, idx, sink = _inputs()  # row 0 is never selected; masked slots exist
    ref = _fwd_bwd(q, kv, idx, sink)
    kv2 = kv.clone()
    kv2[0] = bad
    got = _fwd_bwd(q, kv2, idx, sink)
    for a, b in zip(got, ref):
        assert torch.equal(a[..., 1:, :] if a.dim() == 2 and a.shape == kv.shape else a,
                           b[..., 1:, :] if b.dim() == 2 and b.shape == kv.shape else b)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[2]).all()


def test_one_samples_rows_never_reach_another_sample():
    """Batched layout: sample 0's row 0 is NaN and selected by none of sample 1's ids (its
    masked and out-of-range ids included)."""
    q, kv, idx, sink = _inputs(T=4, N=6, K=5)
    qb = torch.stack([q, q])
    kvb = torch.stack([kv, kv])
    idxb = torch.stack([idx.clamp(min=1), idx])  # sample 0 never selects its row 0 either
    ref = dsv4_sparse_attn.sparse_mla(qb, kvb, idxb, sink)
    kvb[0, 0] = float("nan")
    got = dsv4_sparse_attn.sparse_mla(qb, kvb, idxb, sink)
    assert torch.equal(got, ref)


def test_nan_sink_makes_its_head_nan_only():
    q, kv, idx, sink = _inputs()
    sink[1] = float("nan")
    out, lse, dq, dkv, dsink = _fwd_bwd(q, kv, idx, sink)
    assert torch.isnan(out[:, 1]).all() and torch.isnan(lse[:, 1]).all()
    assert torch.isfinite(out[:, [0, 2]]).all() and torch.isfinite(lse[:, [0, 2]]).all()
    assert torch.isfinite(dq[:, [0, 2]]).all()


def test_plus_inf_sink_takes_all_the_weight():
    """A +inf sink: out 0, lse +inf, and no gradient to q or kv from that head."""
    q, kv, idx, sink = _inputs()
    base = sink.clone()
    base[1] = -math.inf  # the head as if it had no slots' mass
    sink[1] = math.inf
    out, lse, dq, dkv, dsink = _fwd_bwd(q, kv, idx, sink)
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    assert torch.equal(lse[:, 1], torch.full_like(lse[:, 1], math.inf))
    assert torch.equal(dq[:, 1], torch.zeros_like(dq[:, 1]))
    assert torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dkv).all()


def test_minus_inf_sink_is_no_sink():
    q, kv, idx, sink = _inputs()
    sink[:] = -math.inf
    a = _fwd_bwd(q, kv, idx, sink)
    b = _fwd_bwd(q, kv, idx, None)
    for x, y in zip(a[:4], b[:4]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("with_sink", [True, False])
def test_empty_kv(with_sink):
    q, _, idx, sink = _inputs()
    kv = torch.zeros(0, D, dtype=torch.float64)
    sink = sink if with_sink else None
    out, lse, dq, dkv, dsink = _fwd_bwd(q, kv, idx, sink)
    assert torch.equal(out, torch.zeros_like(out)) and dkv.shape == (0, D)
    want = sink.expand_as(lse) if with_sink else torch.full_like(lse, -math.inf)
    assert torch.equal(lse, want)
    assert torch.equal(dq, torch.zeros_like(dq))


@pytest.mark.parametrize("scale", [1e300, 1e-300, 1e39])
def test_scale_must_be_a_usable_float32(scale):
    q, kv, idx, sink = _inputs()
    with pytest.raises(ValueError, match="float32"):
        torch.ops.dsv4.sparse_mla(q, kv, idx, sink, scale)


def test_bool_scale_or_d_v_is_refused():
    """The Python API refuses a bool scale or d_v (the ops' schemas would take True as 1.0
    and 1: d_v=True would return [T, H, 1] from kv's first column)."""
    q, kv, idx, sink = _inputs()
    with pytest.raises(TypeError, match="scale must be a float or None, got bool"):
        dsv4_sparse_attn.sparse_mla(q, kv, idx, sink, True)
    with pytest.raises(TypeError, match="d_v must be an int or None, got bool"):
        dsv4_sparse_attn.sparse_mla(q, kv, idx, sink, d_v=True)
