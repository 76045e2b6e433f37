"""The deterministic mode's exact two-word grad_kv sums (kernels/exact_sums.py) under the
Triton interpreter: the rows' bounds hold every term the backward adds, the words sum to
the same bits in any order, and the backward (Triton main kernel) gives grad_kv bitwise
the same whatever the order of the tokens."""
import os

import pytest
import torch

from helpers import oracle_bwd, relerr
from kernel_checks import Case, make_case, make_lengths

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 set before triton is imported "
           "(tests/interpreter/conftest.py reruns these tests in a child process with it)")

FP = torch.float16


def _case(c: Case, d_v=None, dlse=True):
    """Inputs of ``c`` with the forward's out and lse, a grad_out and grad_lse, Delta."""
    from dsv4_sparse_attn.kernels import forward_triton as kfwd

    q, kv, idx, sink = make_case(c, "cpu")
    length = make_lengths(c, "cpu")
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, c.D ** -0.5, topk_length=length, d_v=d_v)
    do = torch.randn_like(out)
    dl = torch.randn_like(lse) if dlse else None
    delta = (out.double() * do.double()).sum(-1) - (dl.double() if dl is not None else 0)
    return q, kv, idx, sink, length, out, lse, do, dl, delta.float()


def _terms(q, kv, idx, lse, do, delta, scale, length, sink):
    """float64 [T, K, W]: each (token, slot)'s dKV row, sum_h P dO_h + scale dS q_h (zeros
    for masked slots), from the oracle's P."""
    T, H, W = q.shape
    N, K = kv.shape[0], idx.shape[1]
    D = do.shape[-1]
    ok = (idx >= 0) & (idx < N)
    if length is not None:
        ok &= torch.arange(K)[None, :] < length.clamp(0, K)[:, None].long()
    rows = kv.double()[idx.long().clamp(0, N - 1)]  # [T, K, W]
    s = torch.einsum("thw,tkw->thk", q.double(), rows) * scale
    p = torch.where(ok[:, None, :], torch.exp(s - lse.double()[:, :, None]), 0.0)
    dp = torch.einsum("thd,tkd->thk", do.double(), rows[..., :D])
    ds = p * (dp - delta.double()[:, :, None])
    term = torch.einsum("thk,thw->tkw", ds * scale, q.double())
    term[..., :D] += torch.einsum("thk,thd->tkd", p, do.double())
    return term, ok


@pytest.mark.parametrize("c, d_v", [(Case(6, 5, 64, 20, 30, dtype=FP, ids="dup"), None),
                                    (Case(7, 3, 64, 25, 40, dtype=FP, ids="shared", lengths=True), None),
                                    (Case(5, 4, 64, 30, 20, dtype=FP, sink_scale=-30.0), None),
                                    (Case(4, 2, 576, 20, 9, dtype=FP), 512)], ids=str)
def test_row_bounds_hold_every_term(c, d_v):
    """Each kv row's bound is at least the sum of |terms| at any column over the slots that
    select it, every term lies within the hi grid's range (|x| <= 2^(E_hi - 1)), the count
    is the number of those slots, and the grids are within 2^26 of what the terms need
    (the bound is loose, not absurd)."""
    from dsv4_sparse_attn.kernels import exact_sums

    q, kv, idx, sink, length, out, lse, do, dl, delta = _case(c, d_v)
    scale = c.D ** -0.5
    stats = {}
    codes = exact_sums.row_codes(q, kv, idx, do, delta, scale, length, stats=stats)
    term, ok = _terms(q, kv, idx, lse, do, delta, scale, length, sink)
    N = kv.shape[0]
    rows = torch.where(ok, idx.long(), N)
    absum = torch.zeros(N + 1, term.shape[-1], dtype=torch.float64).index_add_(0, rows.flatten(),
                                                                               term.abs().flatten(0, 1))[:N]
    need = absum.amax(1)
    assert torch.all(stats["bound"] >= need), (stats["bound"], need)
    assert torch.equal(stats["count"].long(), torch.bincount(rows.flatten(), minlength=N + 1)[:N])
    used = stats["count"] > 0
    assert torch.all(torch.exp2(stats["e_hi"] - 1.0)[used] >= need[used])
    assert torch.all((stats["bound"][used] / need[used].clamp_min(1e-300)) < 2.0 ** 26)
    assert not stats["bad"].any() and codes.dtype == torch.int32 and torch.all(codes >> 16 == 1)


def test_two_words_sum_to_the_same_bits_in_any_order():
    """Values of one row (up to its bound, from 2^-60 of it) split into the words of the row's
    grids: their fp32 sums, in twenty orders, are bitwise equal, and hi + lo is within
    count * 2^(E_lo - 24) of the exact sum."""
    import numpy as np

    from dsv4_sparse_attn.kernels import exact_sums

    gen = torch.Generator().manual_seed(1)
    n = 3000
    x = (torch.exp2(-torch.empty(n).uniform_(0, 60, generator=gen))
         * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)).float()
    bound = x.double().abs().sum().item()
    e_hi = int(np.frexp(bound * exact_sums.BOUND_SLACK)[1]) + 1
    e_lo = e_hi - 24 + int(np.frexp(float(n))[1]) + 1
    code = torch.tensor(exact_sums.CODE_VALID | ((e_hi + 127) << 8) | (e_lo + 127))
    c_hi, c_lo = exact_sums.grids(code)
    hi, lo = exact_sums.split_words(x, c_hi, c_lo)
    sums = set()
    for _ in range(20):
        perm = torch.randperm(n, generator=gen)
        h = np.float32(0)
        lw = np.float32(0)
        for v, w in zip(hi[perm].numpy(), lo[perm].numpy()):
            h = np.float32(h + v)
            lw = np.float32(lw + w)
        sums.add((float(h), float(lw)))
    assert len(sums) == 1
    (h, lw), = sums
    exact = x.double().sum().item()
    assert abs((h + lw) - exact) <= n * 2.0 ** (e_lo - 24)
    assert abs((h + lw) - exact) < 1e-6 * bound


@pytest.mark.parametrize("c, d_v", [(Case(9, 5, 64, 12, 30, dtype=FP, ids="shared"), None),
                                    (Case(8, 70, 64, 30, 20, dtype=FP, ids="dup", lengths=True), None),
                                    (Case(6, 3, 576, 20, 9, dtype=FP), 512)], ids=str)
def test_exact_backward_is_the_same_for_any_token_order(c, d_v):
    """The deterministic backward with exact sums (Triton main kernel), its tokens permuted:
    grad_kv bitwise equal, grad_q permuted likewise (grad_sink to fp32 rounding: a sum in
    token order), and all three against the
    float64 oracle; the fold's grad_kv (exact=False) agrees to the output's rounding."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton

    q, kv, idx, sink, length, out, lse, do, dl, delta = _case(c, d_v)
    scale = c.D ** -0.5

    def run(perm, exact=True):
        pl = length[perm] if length is not None else None
        return kbwd.sparse_mla_bwd(do[perm], dl[perm], q[perm], kv, out[perm], lse[perm], idx[perm], sink,
                                   scale, main=backward_triton, deterministic=True, topk_length=pl,
                                   exact=exact)

    ident = torch.arange(c.T)
    a = run(ident)
    for seed in range(2):
        perm = torch.randperm(c.T, generator=torch.Generator().manual_seed(seed))
        b = run(perm)
        assert torch.equal(a[1], b[1]) and torch.equal(a[0][perm], b[0])
        # (grad_sink sums its tokens in token order: its bits follow that order)
        torch.testing.assert_close(a[2], b[2], rtol=1e-5, atol=1e-6)
    rq, rkv, rs = oracle_bwd(do, dl, q, kv, idx, sink, None, length, d_v)
    assert relerr(a[0], rq) < 3e-3 and relerr(a[1], rkv) < 3e-3 and relerr(a[2], rs) < 1e-3
    fold = run(ident, exact=False)
    assert relerr(a[1], fold[1]) < 1e-3


def test_exact_backward_nonfinite_token_reaches_only_its_rows():
    """A NaN in one token's grad_out: the kv rows that token selects get NaN in grad_kv (their
    bound is not finite), every other row stays finite and equal to the run without it."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton

    c = Case(6, 4, 64, 40, 10, dtype=FP)
    q, kv, idx, sink, length, out, lse, do, dl, delta = _case(c)
    scale = c.D ** -0.5
    bad = do.clone()
    bad[2, 1, 5] = float("nan")
    a = kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, scale, main=backward_triton,
                            deterministic=True, exact=True)
    b = kbwd.sparse_mla_bwd(bad, dl, q, kv, out, lse, idx, sink, scale, main=backward_triton,
                            deterministic=True, exact=True)
    hit = torch.zeros(c.N, dtype=torch.bool)
    sel = idx[2][(idx[2] >= 0) & (idx[2] < c.N)].long()
    hit[sel] = True
    assert hit.any() and torch.isnan(b[1][hit]).all(dim=1).all()
    # (the other rows' terms and bounds are those of the run without the NaN: the same bits)
    assert torch.isfinite(b[1][~hit]).all() and torch.equal(a[1][~hit], b[1][~hit])
