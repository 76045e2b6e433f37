"""Triton forward kernel of sparse MLA: out [T, H, D] and the sink-inclusive lse [T, H].

One program per (token, block of heads). All heads of a token share the same K
gathered rows, so the GEMMs are M = heads (BLOCK_H), N = slots (BLOCK_K), reduction
D. D is split in two halves so each accumulator half is a separate wgmma chain
(a [64, 512] fp32 accumulator in one piece spills at 4 warps). Online softmax in
base 2; the sink joins the denominator at the end.

T, N, H, K and the index/lse strides are runtime values excluded from Triton's
specialisation, so a new sequence length or top-k never recompiles.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (LOG2E, finish_softmax, head_block, interpreting, last_dim_contiguous, load_tile,
                     slot_end, slot_rows, triton_rejects)

# Values that change from call to call (sequence length, top-k, pool size) are never
# specialised; the row strides of q, kv and out (multiples of D in practice) are, so
# Triton can prove 16-byte alignment and vectorise the row gathers.
FWD_RUNTIME_INTS = ["T", "H", "N", "K", "stride_it", "stride_lt"]


@triton.jit(do_not_specialize=FWD_RUNTIME_INTS)
def _sparse_mla_fwd_kernel(
    Q, KV, IDX, SINK, OUT, LSE, LEN,
    T, H, N, K,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt,
    scale_log2,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_LEN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROPE: tl.constexpr = 0,
):
    # D: the value columns (out's width); q and kv rows have D + ROPE columns, the last
    # ROPE of them (the V3.2 layout's rotary part) in the scores only.
    HALF: tl.constexpr = D // 2
    # int64 program ids: T*H*D and N*D exceed 2**31 at DeepSeek scale.
    pid_t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_d = tl.arange(0, HALF)

    q_ptr = Q + pid_t * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh + offs_d[None, :]
    q0 = load_tile(q_ptr, h_mask[:, None], DOT_FP32)
    q1 = load_tile(q_ptr + HALF, h_mask[:, None], DOT_FP32)
    if ROPE > 0:
        offs_r = tl.arange(0, ROPE)
        q_r_ptr = Q + pid_t * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh + D + offs_r[None, :]
        q_r = load_tile(q_r_ptr, h_mask[:, None], DOT_FP32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)

    idx_row = IDX + pid_t * stride_it
    k_end = slot_end(LEN, pid_t, K, HAS_LEN)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        valid, rows = slot_rows(idx_row, offs_k, k_end, N)
        kv_ptr = KV + rows[:, None] * stride_kvn + offs_d[None, :]
        kv0 = load_tile(kv_ptr, valid[:, None], DOT_FP32)
        kv1 = load_tile(kv_ptr + HALF, valid[:, None], DOT_FP32)

        s = tl.dot(q0, tl.trans(kv0))
        s = tl.dot(q1, tl.trans(kv1), s)
        if ROPE > 0:
            kv_r = load_tile(KV + rows[:, None] * stride_kvn + D + offs_r[None, :], valid[:, None], DOT_FP32)
            s = tl.dot(q_r, tl.trans(kv_r), s)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_mm = p.to(kv0.dtype)
        acc0 = tl.dot(p_mm, kv0, acc0 * alpha[:, None])
        acc1 = tl.dot(p_mm, kv1, acc1 * alpha[:, None])
        m_i = m_new

    if HAS_SINK:
        sink2 = tl.load(SINK + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
    else:
        sink2 = m_i  # unused
    w, lse = finish_softmax(m_i, l_i, sink2, HAS_SINK)

    o_ptr = OUT + pid_t * stride_ot + offs_h[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
    tl.store(o_ptr, (acc0 * w[:, None]).to(OUT.dtype.element_ty), mask=h_mask[:, None])
    tl.store(o_ptr + HALF, (acc1 * w[:, None]).to(OUT.dtype.element_ty), mask=h_mask[:, None])
    tl.store(LSE + pid_t * stride_lt + offs_h, lse, mask=h_mask)


class FwdConfig(NamedTuple):
    BLOCK_H: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


def forward_config(D: int, H: int) -> FwdConfig:
    """Block sizes per value dim and head count (the 64 score-only columns of the V3.2 layout
    fit the same tiles; docs/performance/forward.md#tile-warp-and-stage-sweep)."""
    block_h = head_block(H)
    if D == 512:
        # 64x64 tiles, 8 warps, 2 stages: best plain-Triton point on H200.
        return FwdConfig(block_h, 64, 8 if block_h == 64 else 4, 2)
    if D == 256:
        return FwdConfig(block_h, 64, 8 if block_h == 64 else 4, 2)
    return FwdConfig(block_h, 64, 4, 3)


def prepare_forward(q, kv, indices, attn_sink, scale, out=None, lse=None, d_v=None):
    """What the Triton and the Gluon forward launchers share: the outputs (allocated
    unless given) and the kernel's leading arguments (pointers, sizes, strides, scale),
    None when T == 0 (nothing to launch)."""
    T, H, D = q.shape
    if out is None:
        out = torch.empty((T, H, D if d_v is None else d_v), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse, None
    q, kv, indices, attn_sink = (last_dim_contiguous(x) for x in (q, kv, indices, attn_sink))
    sink = attn_sink if attn_sink is not None else lse  # dummy pointer when HAS_SINK is off
    args = (q, kv, indices, sink, out, lse,
            T, H, kv.shape[0], indices.shape[1],
            q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
            lse.stride(0),
            scale * LOG2E)
    return out, lse, args


def sparse_mla_fwd(q, kv, indices, attn_sink, scale, config: FwdConfig | None = None,
                   out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                   topk_length: torch.Tensor | None = None, d_v: int | None = None):
    """Launch the forward. q [T,H,D], kv [N,D] (bf16/fp16), indices [T,K] int32/int64,
    topk_length None or int32 [T] (the slots past it are skipped), d_v None (D) or
    D - 64 (the last 64 columns score only; ``triton_rejects`` has the rule).

    ``out``/``lse`` may be given (contiguous; tests pass poisoned buffers to catch
    unwritten elements). CPU tensors run under the Triton interpreter (tests only).
    """
    out, lse, args = prepare_forward(q, kv, indices, attn_sink, scale, out, lse, d_v)
    if args is None:
        return out, lse
    T, H, D = q.shape
    dv = D if d_v is None else d_v
    cfg = config or forward_config(dv, H)
    q_args, rest = args[:6], args[6:]
    _sparse_mla_fwd_kernel[(T, triton.cdiv(H, cfg.BLOCK_H))](
        *q_args, topk_length if topk_length is not None else indices, *rest,
        D=dv, ROPE=D - dv, BLOCK_H=cfg.BLOCK_H, BLOCK_K=cfg.BLOCK_K, HAS_SINK=attn_sink is not None,
        HAS_LEN=topk_length is not None,
        DOT_FP32=interpreting(q.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


NAME = "triton"


def rejects(call) -> str | None:
    """Why this kernel does not run ``call``'s forward (None: it does): ``triton_rejects``."""
    return triton_rejects(call)
