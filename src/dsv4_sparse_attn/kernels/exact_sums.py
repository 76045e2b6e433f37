"""Exact, order-independent fp32 sums for the deterministic backward's grad_kv: a
measurement option, off by default (``backward.EXACT_SUMS``; measured 2.1-2.3x the fast
mode's time and too loose a bound for heavily shared rows:
docs/performance/backward.md#exact-two-word-sums-measured-off).

The main kernel adds every (token, slot) dKV row to its kv row with fp32 reductions, as
in the fast mode, but each value x is first split into two words that lie on a grid of
the row's own:

    hi = (x + C_hi) - C_hi         lo = ((x - hi) + C_lo) - C_lo

with C = 1.5 * 2^E: ``x + C`` rounds x to a multiple of 2^(E - 23) while |x| <= 2^(E - 1)
(two full-rate adds), and ``x - hi`` is exact. Multiples of a grid g add exactly in fp32,
in any order, while every partial sum stays within 2^24 g. So the hi words go to one fp32
row and the lo words to a second, each sum is exact, and the row's result hi + lo does
not depend on the order of the additions: the same bits run to run, for any schedule,
chunking or GPU.

What makes the sums exact is a bound B_n >= sum of |x| over every value added to column
d of kv row n (any d), taken before the main kernel from what it reads anyway:

    |dKV term of (t, slot)| <= sum_h P * max_d |dO_th| + scale * |dS| * max_d |q_th|,
    P <= 1,  |dS| = P |dP - Delta_th| <= ||dO_th||_2 ||v_n||_2 + |Delta_th|

so B_n = sum over the slots (t, j) that select n of a_t + c_t ||v_n||, with
a_t = sum_h (max|dO_th| + scale max|q_th| |Delta_th|) and c_t = scale sum_h max|q_th| ||dO_th||.
(It holds when lse is the forward's, so that P <= 1.) The per-row sums of a_t and c_t are
integer (fixed-point, rounded up) atomics, exact in any order, so B_n, and with it the grid,
is itself deterministic. With c_n the row's count of slots,

    E_hi = ceil(log2 B_n) + 1        (|x| <= 2^(E_hi - 1); sum of |hi| <= 2^(E_hi + 1))
    E_lo = E_hi - 24 + ceil(log2 c_n) + 1   (sum of |lo| <= c_n 2^(E_hi - 24) + ...)

The error of a row's sum is at most c_n * 2^(E_lo - 24), about c_n^2 B_n 2^-45 (the lo
words' rounding); B_n is a loose bound (P <= 1, Cauchy-Schwarz), which the second word
pays for. The grids of a row travel to the kernel as one int32 code: bit 16 set (0 is a
masked slot), the biased exponents of C_hi and C_lo in bits 8-15 and 0-7; 255 in the first
(C_hi a NaN) marks a row whose bound is not finite: its gradient is NaN, as a non-finite
input makes it in either mode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# fixed-point bits of a token's share of its rows' bounds (a_t and c_t over their maxima,
# rounded up): the sums fit in int64 for up to 2^32 slots a row
FIXED_BITS = 31
# the bound's slack for the rounding of P, dS (bf16) and of the bound's own arithmetic
BOUND_SLACK = 1.0 + 2.0 ** -6
CODE_VALID = 1 << 16


@triton.jit(do_not_specialize=["H", "stride_qt", "stride_qh", "stride_dt", "stride_dh"])
def _head_bounds_kernel(Q, DO, DELTA, A, C, H, stride_qt, stride_qh, stride_dt, stride_dh, scale,
                        W: tl.constexpr, BLOCK_W: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    """A[t, h] = max|dO_th| + scale max|q_th| |Delta_th|, C[t, h] = scale max|q_th| ||dO_th||_2
    (q over its W columns, dO over its D value columns)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_w = tl.arange(0, BLOCK_W)
    q = tl.load(Q + t * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh + offs_w[None, :],
                mask=h_ok[:, None] & (offs_w < W)[None, :], other=0.0).to(tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    do = tl.load(DO + t * stride_dt + offs_h[:, None].to(tl.int64) * stride_dh + offs_d[None, :],
                 mask=h_ok[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
    mq = tl.max(tl.abs(q), 1)
    mdo = tl.max(tl.abs(do), 1)
    ndo = tl.sqrt(tl.sum(do * do, 1))
    delta = tl.load(DELTA + t * H + offs_h, mask=h_ok, other=0.0)
    tl.store(A + t * H + offs_h, mdo + scale * mq * tl.abs(delta), mask=h_ok)
    tl.store(C + t * H + offs_h, scale * mq * ndo, mask=h_ok)


@triton.jit(do_not_specialize=["T", "K", "N", "stride_it"])
def _row_bounds_kernel(IDX, LEN, QA, QC, BAD, SA, SC, CNT, NBAD, T, K, N, stride_it,
                       HAS_LEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """For every slot of token t that selects a row n (0 <= id < N, slot < length):
    SA[n] += QA[t], SC[n] += QC[t], CNT[n] += 1, and NBAD[n] += 1 where the token's bound
    is not finite (BAD[t]). Integer adds: the same sums in any order."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = offs < K
    if HAS_LEN:
        ok &= offs < tl.load(LEN + t)
    ids = tl.load(IDX + t * stride_it + offs, mask=ok, other=-1)
    ok &= (ids >= 0) & (ids < N)
    rows = tl.where(ok, ids, 0).to(tl.int64)
    qa = tl.load(QA + t)
    qc = tl.load(QC + t)
    bad = tl.load(BAD + t)
    tl.atomic_add(SA + rows, tl.zeros([BLOCK_K], tl.int64) + qa, mask=ok, sem="relaxed")
    tl.atomic_add(SC + rows, tl.zeros([BLOCK_K], tl.int64) + qc, mask=ok, sem="relaxed")
    tl.atomic_add(CNT + rows, tl.full([BLOCK_K], 1, tl.int32), mask=ok, sem="relaxed")
    # (the flag as a block first: Triton 3.9's interpreter rejects a mask from a block & a scalar)
    bad_k = tl.zeros([BLOCK_K], tl.int32) + bad
    tl.atomic_add(NBAD + rows, bad_k, mask=ok & (bad_k != 0), sem="relaxed")


def _fixed(x: torch.Tensor, finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x >= 0 [T] (fp32) as int64 fixed point of its finite maximum, rounded up; and that
    maximum (float64, a 0-d tensor; 1 where every value is 0)."""
    x = torch.where(finite, x, 0.0).double()
    top = x.amax() if x.numel() else x.new_zeros(())
    top = torch.where(top > 0, top, 1.0)
    return torch.ceil(x / top * 2.0 ** FIXED_BITS).long(), top


def row_codes(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, grad_out: torch.Tensor,
              delta: torch.Tensor, scale: float, topk_length: torch.Tensor | None = None,
              stats: dict | None = None) -> torch.Tensor:
    """int32 [N]: each kv row's grid code (module docstring) for this backward call: ``q``
    [T, H, W], ``kv`` [N, W], ``indices`` [T, K], ``grad_out`` [T, H, D] (the value
    columns kv[:, :D]), ``delta`` fp32 [T, H] (rowsum(O dO) - dLSE). No host sync.
    ``stats`` (tests): takes the rows' bounds B (float64), counts and exponents."""
    T, H, W = q.shape
    N, K = kv.shape[0], indices.shape[1]
    D = grad_out.shape[-1]
    dev = q.device
    sa = torch.zeros(N, dtype=torch.int64, device=dev)
    sc = torch.zeros(N, dtype=torch.int64, device=dev)
    cnt = torch.zeros(N, dtype=torch.int32, device=dev)
    nbad = torch.zeros(N, dtype=torch.int32, device=dev)
    if T and H and K and N:
        a = torch.empty((T, H), dtype=torch.float32, device=dev)
        c = torch.empty((T, H), dtype=torch.float32, device=dev)
        bh = min(triton.next_power_of_2(H), 16)
        _head_bounds_kernel[(T, triton.cdiv(H, bh))](
            q, grad_out, delta, a, c, H, q.stride(0), q.stride(1), grad_out.stride(0), grad_out.stride(1),
            float(scale), W=W, BLOCK_W=triton.next_power_of_2(W), D=D, BLOCK_D=triton.next_power_of_2(D),
            BLOCK_H=bh, num_warps=4)
        a_t, c_t = a.sum(1), c.sum(1)  # (fixed-order reductions)
        finite = torch.isfinite(a_t) & torch.isfinite(c_t)
        qa, a_top = _fixed(a_t, finite)
        qc, c_top = _fixed(c_t, finite)
        bad = (~finite).to(torch.int32)
        block_k = min(triton.next_power_of_2(K), 1024)
        _row_bounds_kernel[(T, triton.cdiv(K, block_k))](
            indices, topk_length if topk_length is not None else indices, qa, qc, bad, sa, sc, cnt, nbad,
            T, K, N, indices.stride(0), HAS_LEN=topk_length is not None, BLOCK_K=block_k, num_warps=4)
    else:
        a_top = c_top = torch.ones((), dtype=torch.float64, device=dev)
    v_norm = kv[:, :D].float().square().sum(1).sqrt().double()
    unit = 2.0 ** -FIXED_BITS
    bound = (sa.double() * (a_top * unit) + v_norm * (sc.double() * (c_top * unit))) * BOUND_SLACK
    e_hi = torch.frexp(bound).exponent.long() + 1  # 2^(e_hi - 1) >= bound
    e_lo = e_hi - 24 + torch.frexp(cnt.double()).exponent.long() + 1  # + ceil(log2 count) + 1 at least
    e_hi, e_lo = e_hi.clamp_min(-126), e_lo.clamp_min(-126)  # (C normal)
    bad_row = (nbad > 0) | ~torch.isfinite(bound) | (e_hi > 127) | (e_lo > 127)
    b_hi = torch.where(bad_row, 255, e_hi.clamp_max(127) + 127)
    b_lo = torch.where(bad_row, 255, e_lo.clamp_max(127) + 127)
    if stats is not None:
        stats.update(bound=bound, count=cnt, e_hi=e_hi, e_lo=e_lo, bad=bad_row)
    return (CODE_VALID | (b_hi << 8) | b_lo).to(torch.int32)


def grids(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 constants C_hi, C_lo = 1.5 * 2^E of each code (the kernels' decoding)."""
    c = codes.to(torch.int64)
    hi = ((((c >> 8) & 255) << 23) | 0x400000).to(torch.int32).view(torch.float32)
    lo = (((c & 255) << 23) | 0x400000).to(torch.int32).view(torch.float32)
    return hi, lo


def split_words(x: torch.Tensor, c_hi: torch.Tensor, c_lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two words of fp32 values ``x`` on the grids of C_hi and C_lo (broadcast): what the
    kernels add (for tests and the reference of the rounding)."""
    hi = (x + c_hi) - c_hi
    lo = ((x - hi) + c_lo) - c_lo
    return hi, lo


@triton.jit
def split_to_grid(x, code):
    """The kernels' form of ``split_words``: ``x`` fp32 and its row's int32 ``code``
    (broadcast) -> (hi, lo)."""
    c_hi = ((((code >> 8) & 255) << 23) | 0x400000).to(tl.float32, bitcast=True)
    c_lo = (((code & 255) << 23) | 0x400000).to(tl.float32, bitcast=True)
    hi = (x + c_hi) - c_hi
    lo = ((x - hi) + c_lo) - c_lo
    return hi, lo
