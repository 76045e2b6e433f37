"""Triton backward of sparse MLA: grad_q, grad_kv, grad_sink (DESIGN.md section 1).

Three phases:
1. ``_bwd_delta_kernel``: Delta = rowsum(O * dO) - dLSE, fp32 [T, H].
2. ``_bwd_main_kernel``, one program per (token, block of heads): recomputes
   P = exp(S - lse) slot block by slot block, accumulates dQ in registers (fp32,
   rounded once) and forms each slot block's dKV rows dS^T Q * scale + P^T dO
   (summed over the block's heads). Those rows go either
   - deterministic (default): to a per-(token, head block, slot) fp32 buffer for a
     chunk of tokens, then ``_dkv_reduce_kernel`` sums, for every kv row, its
     entries in a fixed (sorted) order into the fp32 grad_kv accumulator; or
   - atomic (opt-in, ``deterministic=False``): fp32 atomic adds into grad_kv;
     faster, but the summation order (and so the last bits) varies run to run.
3. grad_sink = -sum_t exp(sink - lse) * Delta, a [T, H] reduction in PyTorch.

The chunk of tokens bounds the buffer (``PARTIAL_BYTES``) whatever T is. On sm_90 with
D = 512 the main kernel is the Gluon one (``backward_gluon``, ``gluon=True``),
which pads each token's partial rows to whole 64-slot blocks and, with an even number of
head blocks, keeps one row per pair of head blocks.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (LOG2E, cuda_properties, head_block, interpreting, last_dim_contiguous, load_tile,
                     next_pow2, slot_rows)

# Bound on the deterministic path's per-slot fp32 dKV buffer (the whole extra memory
# of the backward is this plus O(T*H + N*D) fp32): under the 1 GiB the backward may
# use, and as large as that allows, since fewer chunks mean fewer partial waves.
PARTIAL_BYTES = 896 * 2**20


@triton.jit(do_not_specialize=["H", "stride_gt"])
def _bwd_delta_kernel(
    OUT, DO, DLSE, DELTA,
    H, stride_ot, stride_oh, stride_dt, stride_dh, stride_gt,
    D: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_d = tl.arange(0, D)
    o = tl.load(OUT + pid_t * stride_ot + offs_h[:, None].to(tl.int64) * stride_oh + offs_d[None, :],
                mask=h_mask[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + pid_t * stride_dt + offs_h[:, None].to(tl.int64) * stride_dh + offs_d[None, :],
                 mask=h_mask[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + pid_t * stride_gt + offs_h, mask=h_mask, other=0.0)
    tl.store(DELTA + pid_t * H + offs_h, delta, mask=h_mask)


# As in the forward: sizes and the index/lse strides are runtime values; the row
# strides of q, kv, dO and dQ are specialised so row gathers vectorise.
_MAIN_RUNTIME_INTS = ["T", "H", "N", "K", "t_begin", "stride_it", "stride_lt"]


@triton.jit
def _dkv_quarter(p_mm, ds_mm, do_x, q_x, ptr, mask, ATOMIC: tl.constexpr):
    """One D quarter of this slot block's dKV rows, transposed: dO^T P + Q^T (scale dS).

    Computed as [D/4, BLOCK_K] so the wgmma M dimension is D/4 (a multiple of 64)
    whatever BLOCK_K is; ``ptr``/``mask`` address the transposed tile.
    """
    part = tl.dot(tl.trans(do_x), p_mm, tl.dot(tl.trans(q_x), ds_mm))
    if ATOMIC:
        tl.atomic_add(ptr, part, mask=mask, sem="relaxed")
    else:
        tl.store(ptr, part, mask=mask)


@triton.jit(do_not_specialize=_MAIN_RUNTIME_INTS)
def _bwd_main_kernel(
    Q, KV, IDX, DO, LSE, DELTA, DQ, DKV, PARTIAL,
    T, H, N, K, t_begin,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_dt, stride_dh,
    stride_lt, stride_gt, stride_gh,
    scale, scale_log2,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # D is handled in four quarters: dQ (4 x [BLOCK_H, D/4] fp32) stays in registers
    # for the whole loop and each dKV quarter is formed and written on its own, which
    # keeps a 64-head, 64-slot, D=512 block under 255 registers without spills.
    QD: tl.constexpr = D // 4
    pid_c = tl.program_id(0).to(tl.int64)  # token within the chunk
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
    lse = tl.load(LSE + pid_t * stride_lt + offs_h, mask=h_mask, other=float("inf"))
    # Rows with lse = -inf (no valid slot, no sink) have P = 0 everywhere.
    row_ok = h_mask & (lse > float("-inf"))
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    delta = tl.load(DELTA + pid_t * H + offs_h, mask=h_mask, other=0.0)

    dq0 = tl.zeros([BLOCK_H, QD], dtype=tl.float32)
    dq1 = tl.zeros([BLOCK_H, QD], dtype=tl.float32)
    dq2 = tl.zeros([BLOCK_H, QD], dtype=tl.float32)
    dq3 = tl.zeros([BLOCK_H, QD], dtype=tl.float32)
    idx_row = IDX + pid_t * stride_it
    # No loop-invariant code motion: LLVM would hoist the wgmma shared-memory descriptors
    # of the q/dO tiles (64-bit, dozens of them) out of the loop and spill them.
    for k0 in tl.range(0, K, BLOCK_K, disable_licm=True):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        valid, rows = slot_rows(idx_row, offs_k, K, N)
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
        p = tl.exp2(s * scale_log2 - lse2[:, None])
        p = tl.where(row_ok[:, None] & valid[None, :], p, 0.0)
        dp = tl.dot(do0, tl.trans(kv0))
        dp = tl.dot(do1, tl.trans(kv1), dp)
        dp = tl.dot(do2, tl.trans(kv2), dp)
        dp = tl.dot(do3, tl.trans(kv3), dp)
        ds = p * (dp - delta[:, None])

        ds_mm = ds.to(kv0.dtype)
        dq0 = tl.dot(ds_mm, kv0, dq0)
        dq1 = tl.dot(ds_mm, kv1, dq1)
        dq2 = tl.dot(ds_mm, kv2, dq2)
        dq3 = tl.dot(ds_mm, kv3, dq3)

        # dKV rows of this slot block (summed over this program's heads), transposed.
        ds_sc = (ds * scale).to(kv0.dtype)
        p_mm = p.to(kv0.dtype)
        offs_dt = tl.arange(0, QD)[:, None]
        if ATOMIC:
            out_ptr = DKV + rows[None, :] * D + offs_dt
            out_mask = valid[None, :]
        else:
            out_ptr = (PARTIAL + ((pid_c * n_hb + pid_h) * K + offs_k[None, :].to(tl.int64)) * D
                       + offs_dt)
            out_mask = (offs_k < K)[None, :]
        _dkv_quarter(p_mm, ds_sc, do0, q0, out_ptr, out_mask, ATOMIC)
        _dkv_quarter(p_mm, ds_sc, do1, q1, out_ptr + QD, out_mask, ATOMIC)
        _dkv_quarter(p_mm, ds_sc, do2, q2, out_ptr + 2 * QD, out_mask, ATOMIC)
        _dkv_quarter(p_mm, ds_sc, do3, q3, out_ptr + 3 * QD, out_mask, ATOMIC)

    dq_ptr = DQ + pid_t * stride_gt + h64 * stride_gh + offs_d
    tl.store(dq_ptr, (dq0 * scale).to(DQ.dtype.element_ty), mask=hm)
    tl.store(dq_ptr + QD, (dq1 * scale).to(DQ.dtype.element_ty), mask=hm)
    tl.store(dq_ptr + 2 * QD, (dq2 * scale).to(DQ.dtype.element_ty), mask=hm)
    tl.store(dq_ptr + 3 * QD, (dq3 * scale).to(DQ.dtype.element_ty), mask=hm)


@triton.jit(do_not_specialize=["K", "k_stride", "n_hb"])
def _dkv_reduce_kernel(
    PARTIAL, ORDER, SEG, DKV, K, k_stride, n_hb,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """grad_kv[n] += the sum of row n's per-slot partials, in sorted (fixed) order.

    BLOCK_E entries are gathered at once (memory-level parallelism: a pool row can
    have thousands of entries) and summed as a tree of fixed shape: deterministic.
    """
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(SEG + row)
    end = tl.load(SEG + row + 1)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        e_mask = offs_e < end
        entry = tl.load(ORDER + offs_e, mask=e_mask, other=0)  # flat (token-in-chunk, slot)
        tok = entry // K
        slot = entry - tok * K
        for hb in range(0, n_hb):
            ptr = PARTIAL + (((tok * n_hb + hb) * k_stride + slot) * D)[:, None] + offs_d[None, :]
            acc += tl.sum(tl.load(ptr, mask=e_mask[:, None], other=0.0), 0)
    ptr = DKV + row * D + offs_d
    tl.store(ptr, tl.load(ptr) + acc)


class BwdConfig(NamedTuple):
    BLOCK_H: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


def backward_config(D: int, H: int) -> BwdConfig:
    """Block sizes per head dim and head count (measurements in benchmarks/NOTES.md)."""
    block_h = head_block(H)
    if D == 512:
        return BwdConfig(block_h, 64, 8 if block_h == 64 else 4, 1)
    if D == 256:
        return BwdConfig(block_h, 32, 8 if block_h == 64 else 4, 2)
    return BwdConfig(block_h, 32, 4, 2)


def chunk_tokens(T: int, n_hb: int, K: int, D: int, budget: int, n_sm: int = 0) -> int:
    """Tokens per chunk so that the per-slot fp32 dKV buffer stays under ``budget``.

    With ``n_sm`` (the GPU's SM count) a chunk smaller than T is rounded down to whole
    waves of programs (one program per SM at D=512): a chunk of 1.7 waves leaves 30%
    of the GPU idle in its second wave, for every chunk.
    """
    per_token = max(1, n_hb * K * D * 4)
    chunk = max(1, min(T, budget // per_token))
    if n_sm and chunk < T:
        wave = math.lcm(n_sm, n_hb) // n_hb  # tokens whose programs fill whole waves
        if chunk >= wave:
            chunk -= chunk % wave
    return chunk


def sparse_mla_bwd(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, scale,
                   deterministic: bool = True, config: BwdConfig | None = None,
                   grad_q: torch.Tensor | None = None, gluon: bool = False):
    """Launch the backward; returns grad_q [T,H,D], grad_kv [N,D], grad_sink ([H] or empty).

    ``gluon``: the main kernel is ``backward_gluon``'s (sm_90, D = 512; the caller
    checks ``backward_gluon.supported``); Delta, the dKV reduction and grad_sink
    are shared. CPU tensors run under the Triton interpreter (tests only).
    """
    T, H, D = q.shape
    N, K = kv.shape[0], indices.shape[1]
    q, kv, indices = last_dim_contiguous(q), last_dim_contiguous(kv), last_dim_contiguous(indices)
    grad_out, out = last_dim_contiguous(grad_out), last_dim_contiguous(out)
    lse, grad_lse, attn_sink = (last_dim_contiguous(x) for x in (lse, grad_lse, attn_sink))
    dev = q.device
    if gluon:  # (its blocks are fixed: 64 heads x 64 slots, 3 partitions of NUM_WARPS)
        from . import backward_gluon
        cfg = BwdConfig(64, 64, backward_gluon.NUM_WARPS, 1)
    else:
        cfg = config or backward_config(D, H)
    n_hb = triton.cdiv(H, cfg.BLOCK_H)
    # The Gluon kernel writes its partial rows unmasked, in whole 64-slot blocks, and
    # (deterministic, n_hb even) one row per pair of head blocks.
    k_stride = triton.cdiv(K, 64) * 64 if gluon else K
    paired = gluon and backward_gluon.pairs_head_blocks(n_hb, deterministic)
    n_part = n_hb // 2 if paired else n_hb
    dot_fp32 = interpreting(dev)

    if grad_q is None:  # tests pass a poisoned buffer to catch unwritten elements
        grad_q = torch.empty((T, H, D), dtype=q.dtype, device=dev)
    grad_kv = torch.zeros((N, D), dtype=torch.float32, device=dev)
    delta = torch.empty((T, H), dtype=torch.float32, device=dev)
    if T > 0:
        dh = min(next_pow2(H), max(1, 8192 // D))
        _bwd_delta_kernel[(T, triton.cdiv(H, dh))](
            out, grad_out, grad_lse if grad_lse is not None else delta, delta,
            H, out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1),
            grad_lse.stride(0) if grad_lse is not None else 0,
            D=D, BLOCK_H=dh, HAS_DLSE=grad_lse is not None, num_warps=4,
        )

    def launch(t_begin: int, n_tok: int, partial: torch.Tensor | None, flags: torch.Tensor | None = None):
        if gluon:
            backward_gluon.launch_main(q, kv, indices, grad_out, lse, delta, grad_q, grad_kv, partial, flags,
                                       T, H, N, K, t_begin, n_tok, scale, scale * LOG2E, n_hb, paired)
            return
        _bwd_main_kernel[(n_tok, n_hb)](
            q, kv, indices, grad_out, lse, delta, grad_q, grad_kv,
            partial if partial is not None else grad_kv,
            T, H, N, K, t_begin,
            q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), grad_out.stride(0),
            grad_out.stride(1), lse.stride(0), grad_q.stride(0), grad_q.stride(1),
            scale, scale * LOG2E,
            D=D, BLOCK_H=cfg.BLOCK_H, BLOCK_K=cfg.BLOCK_K, ATOMIC=partial is None,
            DOT_FP32=dot_fp32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    if T > 0 and not deterministic:
        launch(0, T, None, torch.zeros((1,), dtype=torch.int32, device=dev) if gluon else None)
    elif T > 0:
        n_sm = cuda_properties(dev).multi_processor_count if dev.type == "cuda" else 0
        chunk = chunk_tokens(T, n_part, k_stride, D, PARTIAL_BYTES, n_sm)
        partial = torch.empty((chunk, n_part, k_stride, D), dtype=torch.float32, device=dev)
        # The Gluon kernel's per-chunk ticket counter and pair counts (all zero at launch).
        n_chunks = triton.cdiv(T, chunk)
        flags = torch.zeros((n_chunks, 1 + 2 * chunk * n_hb), dtype=torch.int32, device=dev) if gluon else None
        # Sort keys as narrow as N allows: the radix sort makes one pass per key byte
        # (int64 keys: 8 passes, int16: 2).
        key_dtype = torch.int16 if N < 2**15 - 1 else torch.int32 if N < 2**31 - 1 else torch.int64
        rows = torch.arange(N + 1, device=dev, dtype=key_dtype)
        block_d = min(D, 256)
        for t0 in range(0, T, chunk):
            n_tok = min(chunk, T - t0)
            launch(t0, n_tok, partial, flags[t0 // chunk] if gluon else None)
            # Invert the chunk's ids: entries sorted by kv row (stable: fixed order).
            ids = indices[t0:t0 + n_tok].reshape(-1)
            ids = torch.where((ids >= 0) & (ids < N), ids, N).to(key_dtype)
            sorted_ids, order = torch.sort(ids, stable=True)
            seg = torch.searchsorted(sorted_ids, rows)
            _dkv_reduce_kernel[(N, D // block_d)](
                partial, order, seg, grad_kv, K, k_stride, n_part,
                D=D, BLOCK_D=block_d, BLOCK_E=16, num_warps=4,
            )

    if attn_sink is not None:
        grad_sink = -(torch.exp(attn_sink[None, :] - lse) * delta).sum(0)
    else:
        grad_sink = torch.empty((0,), dtype=torch.float32, device=dev)
    return grad_q, grad_kv.to(kv.dtype), grad_sink
