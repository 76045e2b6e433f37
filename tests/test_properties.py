"""Properties of the CPU ops (the exact reference) against tests/properties.py's float64
oracle: random shapes down to 0 and 1, every id pattern, non-finite sinks and inputs,
flat and batched (one sample's rows never reach another)."""
import torch
from hypothesis import given
from hypothesis import strategies as st

import dsv4_sparse_attn
from properties import Problem, assert_matches, oracle, problems, property_settings


def run_flat(p: Problem):
    """(out, lse, grad_q, grad_kv, grad_sink) through torch.ops.dsv4.sparse_mla and autograd."""
    q, kv = p.q.clone().requires_grad_(), p.kv.clone().requires_grad_()
    s = None if p.sink is None else p.sink.clone().requires_grad_()
    out, lse = torch.ops.dsv4.sparse_mla(q, kv, p.idx, s, p.scale, p.topk_length, p.d_v)
    leaves = [q, kv] + ([s] if s is not None else [])
    dlse = torch.zeros_like(lse) if p.grad_lse is None else p.grad_lse
    grads = torch.autograd.grad([out, lse], leaves, [p.grad_out, dlse], allow_unused=True,
                                materialize_grads=True)
    return out, lse, grads[0], grads[1], (grads[2] if s is not None else None)


@given(problems())
@property_settings(300)
def test_flat_op_matches_the_oracle(p):
    assert_matches(p, run_flat(p))


@given(problems(T=(0, 4), H=(1, 3), K=(0, 7), N=(0, 6)), st.integers(0, 2**16))
@property_settings(100)
def test_batched_layout_matches_the_oracle_per_sample(p, seed):
    """Two samples: the drawn one and one with other kv values (a poisoned row of sample
    0 may be selected in sample 1: each sample is checked against its own oracle)."""
    g = torch.Generator().manual_seed(seed)
    kv1 = torch.randn(p.kv.shape, generator=g).to(p.kv.dtype)
    qb = torch.stack([p.q, p.q.flip(0)]).requires_grad_()
    kvb = torch.stack([p.kv, kv1]).requires_grad_()
    idxb = torch.stack([p.idx, p.idx.flip(0)])
    s = None if p.sink is None else p.sink.clone().requires_grad_()
    lenb = None if p.topk_length is None else torch.stack([p.topk_length, p.topk_length.flip(0)])
    out, lse = dsv4_sparse_attn.sparse_mla(qb, kvb, idxb, s, p.scale, return_lse=True, topk_length=lenb,
                                           d_v=p.d_v)
    dob = torch.stack([p.grad_out, p.grad_out.flip(0)])
    dlse = torch.zeros_like(lse) if p.grad_lse is None else torch.stack([p.grad_lse, p.grad_lse.flip(0)])
    leaves = [qb, kvb] + ([s] if s is not None else [])
    grads = torch.autograd.grad([out, lse], leaves, [dob, dlse], allow_unused=True, materialize_grads=True)
    refs = []
    for b in range(2):
        pb = Problem(qb[b].detach(), kvb[b].detach(), idxb[b], p.sink, p.scale, dob[b],
                     None if p.grad_lse is None else dlse[b], f"{p.note}, sample {b}", p.exact,
                     None if lenb is None else lenb[b], p.d_v)
        refs.append(oracle(pb))
        assert_matches(pb, (out[b], lse[b], grads[0][b], grads[1][b]), refs[b][:4])
    if s is not None:
        pb = Problem(p.q, p.kv, p.idx, p.sink, p.scale, p.grad_out, p.grad_lse, f"{p.note}, grad_sink",
                     p.exact, p.topk_length, p.d_v)
        assert_matches(pb, (None,) * 4 + (grads[2],), (None,) * 4 + (refs[0][4] + refs[1][4],))
