"""Triton main kernel of the sparse-MLA backward (any H, D in SUPPORTED_D, any CUDA GPU).

The main work of ``backward.py``'s backward: one program per (token, block of heads)
recomputes P = exp(S - lse) slot block by slot block, accumulates dQ in registers (fp32,
rounded once) and forms each slot block's dKV rows dS^T Q * scale + P^T dO (summed over
the block's heads). Those rows go either to the deterministic path's per-(token, head
block, slot) fp32 partial rows, or (fast mode) into the fp32 [N, D] accumulator with
fp32 atomic adds, in natural column order.

D is handled in four quarters: dQ (4 x [BLOCK_H, D/4] fp32) stays in registers for the
whole loop and each dKV quarter is formed and written on its own, which keeps a
64-head, 64-slot, D=512 block under 255 registers. CPU tensors run under the Triton
interpreter (tests only).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import head_block, interpreting, load_tile, scale_words, slot_end, slot_rows, triton_rejects
from .exact_sums import split_to_grid

NAME = "triton"
# 16-bit partial rows (``backward.sparse_mla_bwd(partial16=True)``; not this kernel's default:
# its fp16 build took 1.5x the fp32 one's time at H = 16 and 32, H100): ``launch``
# takes ``partial_exp``
PARTIAL_16 = True
ACC_FAKE_ORDER = False  # the fast mode's accumulator is [N, D] in natural column order


# As in the forward: sizes and the index/lse strides are runtime values; the row
# strides of q, kv, dO and dQ are specialised so row gathers vectorise.
_MAIN_RUNTIME_INTS = ["T", "H", "N", "K", "t_begin", "stride_it", "stride_lt"]


@triton.jit
def _send_part(part, ptr, mask, code, ATOMIC: tl.constexpr, EXACT: tl.constexpr, W: tl.constexpr,
               eptr=None, P16: tl.constexpr = False, SEG: tl.constexpr = 64):
    """A transposed dKV tile to its rows: fp32 atomic adds (``ATOMIC``; ``EXACT``: each value
    split into two words on its row's grid, ``code`` [1, BLOCK_K], the lo word W columns
    on: exact_sums), or stores to the partial rows (``P16``: see ``_store_16``)."""
    if P16:
        _store_16(part, ptr, eptr, mask, SEG)
    elif EXACT:
        hi, lo = split_to_grid(part, code)
        tl.atomic_add(ptr, hi, mask=mask, sem="relaxed")
        tl.atomic_add(ptr + W, lo, mask=mask, sem="relaxed")
    elif ATOMIC:
        tl.atomic_add(ptr, part, mask=mask, sem="relaxed")
    else:
        tl.store(ptr, part, mask=mask)


@triton.jit
def _store_16(part, ptr, eptr, mask, SEG: tl.constexpr = 64):
    """16-bit partial rows (docs/performance/backward.md#partial-rows-in-16-bits): the
    transposed tile ``part`` ([C columns, BLOCK_K slots] fp32) as fp16, each slot's
    ``SEG``-column segment (64; 32 for the score-only columns: ``backward._scaled``) scaled
    by 2^-s so that its largest |value| lies in [2^14, 2^15) (s in [-126, 126]; 0 for a
    zero segment), s stored at ``eptr`` ([C / SEG, BLOCK_K]: the segments' bytes) as its
    biased exponent s + 127. The fold (``backward._sum_parts``) undoes the scale exactly."""
    C: tl.constexpr = part.shape[0]
    BK: tl.constexpr = part.shape[1]
    seg = tl.reshape(part, (C // SEG, SEG, BK))
    big = tl.max(tl.abs(seg), axis=1)  # [C / SEG, BLOCK_K]
    e = ((big.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2) of a normal max
    s = tl.where(big == 0.0, 0, tl.minimum(tl.maximum(e - 14, -126), 126))
    inv = ((127 - s) << 23).to(tl.float32, bitcast=True)  # 2^-s, exact
    v = tl.reshape(seg * inv[:, None, :], (C, BK)).to(tl.float16)
    tl.store(ptr, v, mask=mask)
    tl.store(eptr, (s + 127).to(tl.uint8), mask=mask)


@triton.jit
def _dkv_quarter(p_mm, ds_mm, do_x, q_x, ptr, mask, code, ATOMIC: tl.constexpr, EXACT: tl.constexpr,
                 W: tl.constexpr, eptr=None, P16: tl.constexpr = False):
    """One D quarter of this slot block's dKV rows, transposed: dO^T P + Q^T (scale dS).

    Computed as [D/4, BLOCK_K] so the wgmma M dimension is D/4 (a multiple of 64)
    whatever BLOCK_K is; ``ptr``/``mask`` address the transposed tile.
    """
    part = tl.dot(tl.trans(do_x), p_mm, tl.dot(tl.trans(q_x), ds_mm))
    _send_part(part, ptr, mask, code, ATOMIC, EXACT, W, eptr, P16)


@triton.jit
def _dkv_score_only(ds_mm, q_x, ptr, mask, code, ATOMIC: tl.constexpr, EXACT: tl.constexpr, W: tl.constexpr,
                    eptr=None, P16: tl.constexpr = False):
    """The dKV rows of the score-only (rotary) columns, transposed: Q^T (scale dS); no
    P^T dO term, since those columns are no value. (16-bit rows: two 32-column segments,
    as the Gluon kernel's two consumers store them.)"""
    part = tl.dot(tl.trans(q_x), ds_mm)
    _send_part(part, ptr, mask, code, ATOMIC, EXACT, W, eptr, P16, 32)


@triton.jit(do_not_specialize=_MAIN_RUNTIME_INTS)
def _bwd_main_kernel(
    Q, KV, IDX, DO, LSE, DELTA, DQ, DKV, PARTIAL, LEN, TOK,
    T, H, N, K, t_begin,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_dt, stride_dh,
    stride_lt, stride_gt, stride_gh,
    scale, scale_log2,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    HAS_LEN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROPE: tl.constexpr = 0,
    EXACT: tl.constexpr = False,
    EXP=None,
    P16: tl.constexpr = False,
):
    # D: the value columns (dO's width); q, kv, dQ and dKV rows have W = D + ROPE columns,
    # the last ROPE of them (the V3.2 layout's rotary part) in the scores only.
    W: tl.constexpr = D + ROPE
    # D is handled in four quarters: dQ (4 x [BLOCK_H, D/4] fp32) stays in registers
    # for the whole loop and each dKV quarter is formed and written on its own, which
    # keeps a 64-head, 64-slot, D=512 block under 255 registers without spills.
    QD: tl.constexpr = D // 4
    pid_c = tl.program_id(0).to(tl.int64)  # position within the chunk (its partial rows)
    if HAS_LEN:  # the chunk's tokens by position (backward.length_order)
        pid_t = tl.load(TOK + pid_c).to(tl.int64)
    else:
        pid_t = t_begin + pid_c
    pid_h = tl.program_id(1)
    n_hb = tl.num_programs(1)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    hm = h_mask[:, None]
    offs_d = tl.arange(0, QD)[None, :]
    h64 = offs_h[:, None].to(tl.int64)

    q_ptr = Q + pid_t * stride_qt + h64 * stride_qh + offs_d
    q0 = load_tile(q_ptr, hm, DOT_FP32)
    q1 = load_tile(q_ptr + QD, hm, DOT_FP32)
    q2 = load_tile(q_ptr + 2 * QD, hm, DOT_FP32)
    q3 = load_tile(q_ptr + 3 * QD, hm, DOT_FP32)
    do_ptr = DO + pid_t * stride_dt + h64 * stride_dh + offs_d
    do0 = load_tile(do_ptr, hm, DOT_FP32)
    do1 = load_tile(do_ptr + QD, hm, DOT_FP32)
    do2 = load_tile(do_ptr + 2 * QD, hm, DOT_FP32)
    do3 = load_tile(do_ptr + 3 * QD, hm, DOT_FP32)
    if ROPE > 0:
        offs_r = tl.arange(0, ROPE)[None, :]
        q_r = load_tile(Q + pid_t * stride_qt + h64 * stride_qh + D + offs_r, hm, DOT_FP32)
        dq_r = tl.zeros([BLOCK_H, ROPE], dtype=tl.float32)
    lse = tl.load(LSE + pid_t * stride_lt + offs_h, mask=h_mask, other=float("inf"))
    # Rows with lse = -inf (no valid slot, no sink) have P = 0 everywhere; a NaN lse
    # (a NaN sink) gives NaN P, as in the reference (docs/design.md#non-finite-values).
    row_ok = h_mask & (lse != float("-inf"))
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    delta = tl.load(DELTA + pid_t * H + offs_h, mask=h_mask, other=0.0)

    dq0 = tl.zeros([BLOCK_H, QD], dtype=tl.float32)
    dq1 = tl.zeros([BLOCK_H, QD], dtype=tl.float32)
    dq2 = tl.zeros([BLOCK_H, QD], dtype=tl.float32)
    dq3 = tl.zeros([BLOCK_H, QD], dtype=tl.float32)
    idx_row = IDX + pid_t * stride_it
    # No loop-invariant code motion: LLVM would hoist the wgmma shared-memory descriptors
    # of the q/dO tiles (64-bit, dozens of them) out of the loop and spill them.
    k_end = slot_end(LEN, pid_t, K, HAS_LEN)
    for k0 in tl.range(0, k_end, BLOCK_K, disable_licm=True):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        valid, rows = slot_rows(idx_row, offs_k, k_end, N)
        vm = valid[:, None]
        kv_ptr = KV + rows[:, None] * stride_kvn + offs_d
        kv0 = load_tile(kv_ptr, vm, DOT_FP32)
        kv1 = load_tile(kv_ptr + QD, vm, DOT_FP32)
        kv2 = load_tile(kv_ptr + 2 * QD, vm, DOT_FP32)
        kv3 = load_tile(kv_ptr + 3 * QD, vm, DOT_FP32)

        s = tl.dot(q0, tl.trans(kv0))
        s = tl.dot(q1, tl.trans(kv1), s)
        s = tl.dot(q2, tl.trans(kv2), s)
        s = tl.dot(q3, tl.trans(kv3), s)
        if ROPE > 0:
            kv_r = load_tile(KV + rows[:, None] * stride_kvn + D + offs_r, vm, DOT_FP32)
            s = tl.dot(q_r, tl.trans(kv_r), s)
        p = tl.exp2(s * scale_log2 - lse2[:, None])
        p = tl.where(row_ok[:, None] & valid[None, :], p, 0.0)
        dp = tl.dot(do0, tl.trans(kv0))
        dp = tl.dot(do1, tl.trans(kv1), dp)
        dp = tl.dot(do2, tl.trans(kv2), dp)
        dp = tl.dot(do3, tl.trans(kv3), dp)
        ds = p * (dp - delta[:, None])
        if HAS_LEN:  # slots past the length are absent, not masked: nothing, even 0 * NaN
            ds = tl.where((offs_k < k_end)[None, :], ds, 0.0)

        ds_mm = ds.to(kv0.dtype)
        dq0 = tl.dot(ds_mm, kv0, dq0)
        dq1 = tl.dot(ds_mm, kv1, dq1)
        dq2 = tl.dot(ds_mm, kv2, dq2)
        dq3 = tl.dot(ds_mm, kv3, dq3)
        if ROPE > 0:
            dq_r = tl.dot(ds_mm, kv_r, dq_r)

        # dKV rows of this slot block (summed over this program's heads), transposed.
        ds_sc = (ds * scale).to(kv0.dtype)
        p_mm = p.to(kv0.dtype)
        offs_dt = tl.arange(0, QD)[:, None]
        code = 0
        if EXACT:  # (rows of 2 W: the hi words, then the lo words; PARTIAL holds the codes)
            row_ptr = DKV + rows[None, :] * (2 * W)
            out_mask = valid[None, :]
            code = tl.load(PARTIAL + rows, mask=valid, other=0)[None, :]
        elif ATOMIC:
            row_ptr = DKV + rows[None, :] * W
            out_mask = valid[None, :]
        else:
            row_ptr = PARTIAL + ((pid_c * n_hb + pid_h) * K + offs_k[None, :].to(tl.int64)) * W
            out_mask = (offs_k < K)[None, :]
        out_ptr = row_ptr + offs_dt
        e_ptr = None
        if P16:  # each slot's 64-column segments' scales (a byte a segment)
            tl.static_assert(QD % 64 == 0 and (ROPE == 0 or ROPE == 64) and not ATOMIC and not EXACT)
            # (int64 words, a byte a segment: its scale's biased exponent, the score-only
            # columns two segments of 32; the fold loads a word at once)
            e_bytes: tl.constexpr = 8 * scale_words(W, ROPE > 0)
            e_row = EXP.to(tl.pointer_type(tl.uint8)) + ((pid_c * n_hb + pid_h) * K
                                                         + offs_k[None, :].to(tl.int64)) * e_bytes
            e_ptr = e_row + tl.arange(0, QD // 64)[:, None]
        _dkv_quarter(p_mm, ds_sc, do0, q0, out_ptr, out_mask, code, ATOMIC, EXACT, W, e_ptr, P16)
        _dkv_quarter(p_mm, ds_sc, do1, q1, out_ptr + QD, out_mask, code, ATOMIC, EXACT, W,
                     e_ptr + QD // 64 if P16 else None, P16)
        _dkv_quarter(p_mm, ds_sc, do2, q2, out_ptr + 2 * QD, out_mask, code, ATOMIC, EXACT, W,
                     e_ptr + 2 * (QD // 64) if P16 else None, P16)
        _dkv_quarter(p_mm, ds_sc, do3, q3, out_ptr + 3 * QD, out_mask, code, ATOMIC, EXACT, W,
                     e_ptr + 3 * (QD // 64) if P16 else None, P16)
        if ROPE > 0:
            e_rope = e_row + D // 64 + tl.arange(0, ROPE // 32)[:, None] if P16 else None
            _dkv_score_only(ds_sc, q_r, row_ptr + D + tl.arange(0, ROPE)[:, None], out_mask, code, ATOMIC,
                            EXACT, W, e_rope, P16)

    dq_ptr = DQ + pid_t * stride_gt + h64 * stride_gh + offs_d
    tl.store(dq_ptr, (dq0 * scale).to(DQ.dtype.element_ty), mask=hm)
    tl.store(dq_ptr + QD, (dq1 * scale).to(DQ.dtype.element_ty), mask=hm)
    tl.store(dq_ptr + 2 * QD, (dq2 * scale).to(DQ.dtype.element_ty), mask=hm)
    tl.store(dq_ptr + 3 * QD, (dq3 * scale).to(DQ.dtype.element_ty), mask=hm)
    if ROPE > 0:
        tl.store(DQ + pid_t * stride_gt + h64 * stride_gh + D + offs_r,
                 (dq_r * scale).to(DQ.dtype.element_ty), mask=hm)


class BwdConfig(NamedTuple):
    BLOCK_H: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


def backward_config(D: int, H: int) -> BwdConfig:
    """Block sizes per head dim and head count (docs/performance/backward.md#first-configurations)."""
    block_h = head_block(H)
    if D == 512:
        return BwdConfig(block_h, 64, 8 if block_h == 64 else 4, 1)
    if D == 256:
        return BwdConfig(block_h, 32, 8 if block_h == 64 else 4, 2)
    return BwdConfig(block_h, 32, 4, 2)


def rejects(call) -> str | None:
    """Why this kernel does not run ``call``'s backward main work (None: it does):
    ``triton_rejects``, the same rule as the Triton forward."""
    return triton_rejects(call)


def tile_heads(D: int, H: int) -> int:
    return backward_config(D, H).BLOCK_H


def partial_slots(K: int) -> int:
    """Slots per token of the partial-row buffer (stores are masked past K)."""
    return K


def pairs_head_blocks(n_hb: int, deterministic: bool) -> bool:
    return False


def flags_per_chunk(n_tok: int, n_hb: int) -> int:
    return 0


def exact_sums_ok(W: int, D: int) -> bool:
    """Whether ``launch`` (``exact_codes``) adds exact two-word sums for q width W and D
    value columns: at every width."""
    return True


def launch(q, kv, indices, grad_out, lse, delta, grad_q, acc, partial, flags, t_begin, n_tok, scale,
           scale_log2, paired, topk_length=None, tokens=None, config: BwdConfig | None = None,
           exact_codes=None, partial_exp=None):
    """One chunk of tokens [t_begin, t_begin + n_tok) or, with ``topk_length``, the tokens
    ``tokens`` (int32 [n_tok]; default those of [t_begin, t_begin + n_tok)): dKV rows to
    ``partial`` ([n_tok, n_hb, K, D] fp32, in the chunk's order) or, without it, added to
    ``acc`` ([N, D] fp32; with ``exact_codes``, int32 [N] from ``exact_sums.row_codes``,
    [N, 2 D]: each row's hi words, then its lo words). ``partial_exp`` (16-bit rows): the
    partial rows are fp16 with a scale a 64-column segment here (int64 [n_tok, n_hb, K, words]: a
    biased exponent byte a segment, ``(W / 64 + 7) / 8`` words a row)."""
    if exact_codes is not None and partial is not None:
        raise ValueError("exact_codes: the sums go to the accumulator, not to partial rows")
    T, H, W = q.shape
    D = grad_out.shape[-1]  # the value columns; W - D score-only ones (common.ROPE_D or 0)
    N, K = kv.shape[0], indices.shape[1]
    cfg = config or backward_config(D, H)
    if topk_length is not None and tokens is None:
        tokens = torch.arange(t_begin, t_begin + n_tok, device=q.device, dtype=torch.int32)
    _bwd_main_kernel[(n_tok, triton.cdiv(H, cfg.BLOCK_H))](
        q, kv, indices, grad_out, lse, delta, grad_q, acc,
        partial if partial is not None else exact_codes if exact_codes is not None else acc,
        topk_length if topk_length is not None else indices, tokens if tokens is not None else indices,
        T, H, N, K, t_begin,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), grad_out.stride(0),
        grad_out.stride(1), lse.stride(0), grad_q.stride(0), grad_q.stride(1),
        scale, scale_log2,
        D=D, ROPE=W - D, BLOCK_H=cfg.BLOCK_H, BLOCK_K=cfg.BLOCK_K, ATOMIC=partial is None,
        HAS_LEN=topk_length is not None, EXACT=exact_codes is not None,
        EXP=partial_exp, P16=partial_exp is not None,
        DOT_FP32=interpreting(q.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
