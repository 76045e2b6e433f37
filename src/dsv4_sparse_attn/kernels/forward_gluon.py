"""Gluon forward kernel of sparse MLA for Hopper (sm_90): explicit layouts and pipeline.

Same math and contract as ``forward.py`` (the Triton kernel), written in Gluon to
control what plain Triton decides on its own:

- S = Q KV^T is split across the two warp groups by slot columns (warps [4, 2]);
  Triton's chained-dot rule instead makes both warp groups compute the whole S.
- P goes through shared memory as the A operand of the PV wgmma, so each warp group
  owns half of D of the [64, 512] fp32 accumulator (128 registers a thread).
- KV rows are gathered with cp.async (16-byte chunks, zero-filled when masked) into
  a STAGES-deep shared ring, the next block's gather overlapping this block's math.

One program per (token, 64-head block), 8 warps. Gluon has no interpreter: this
kernel is tested on the GPU (tests/test_kernels_gpu.py) and compiled for sm_90 in CI.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy as cp,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import cuda_properties
from .forward import FWD_RUNTIME_INTS, prepare_forward

BLOCK_H = 64
NUM_WARPS = 8


@gluon.jit
def _load_ids(idx_row, k0, K, offs):
    """Ids of slots k0 + offs (-1 past K), in the layout of ``offs``."""
    offs_k = k0 + offs
    return gl.load(idx_row + offs_k, mask=offs_k < K, other=-1)


@gluon.jit
def _issue_kv_block(kv_buf, KV, ids, N, stride_kvn, offs_d):
    """Gather the kv rows ``ids`` (one per ring-slot row) into one ring slot."""
    ids = ids.to(gl.int64)
    valid = (ids >= 0) & (ids < N)
    rows = gl.where(valid, ids, 0)  # masked ids never form an address
    ptrs = KV + rows[:, None] * stride_kvn + offs_d[None, :]
    cp.async_copy_global_to_shared(kv_buf, ptrs, mask=valid[:, None])


@gluon.jit(do_not_specialize=FWD_RUNTIME_INTS)
def _sparse_mla_fwd_gluon_kernel(
    Q, KV, IDX, SINK, OUT, LSE,
    T, H, N, K,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt,
    scale_log2,
    D: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_SINK: gl.constexpr,
    BENCH_GATHER: gl.constexpr = True,
):
    BH: gl.constexpr = 64
    NW: gl.constexpr = 8
    dtype: gl.constexpr = Q.dtype.element_ty

    # Register layouts: S [BH, BLOCK_K] and O [BH, D], both warps [4, 2] (no duplication).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_K // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2 if D <= 512 else 256, 16])
    # Gather layout: each thread moves 16-byte chunks of a row.
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)

    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, D], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BLOCK_K], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [BH, D], q_sl)
    kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, D], kv_sl)
    p_smem = gl.allocate_shared_memory(dtype, [BH, BLOCK_K], p_sl)

    pid_t = gl.program_id(0).to(gl.int64)
    pid_h = gl.program_id(1)
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
    offs_r = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, ld_layout))

    # Q tile (heads past H zero-filled), in the first copy group with KV block 0.
    h_ld = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, ld_layout))
    q_ptrs = Q + pid_t * stride_qt + h_ld[:, None].to(gl.int64) * stride_qh + offs_d[None, :]
    cp.async_copy_global_to_shared(q_smem, q_ptrs, mask=(h_ld < H)[:, None])

    idx_row = IDX + pid_t * stride_it
    for i in gl.static_range(STAGES - 1):
        _issue_kv_block(kv_smem.index(i), KV, _load_ids(idx_row, i * BLOCK_K, K, offs_r), N, stride_kvn,
                        offs_d)
        cp.commit_group()
    # Ids are loaded one block ahead of their use, so that no global-load latency sits
    # between a barrier and the gather it feeds, or between S and the softmax.
    ids_gather = _load_ids(idx_row, (STAGES - 1) * BLOCK_K, K, offs_r)
    offs_c = gl.arange(0, BLOCK_K, layout=col_l)
    ids_soft = _load_ids(idx_row, 0, K, offs_c)

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([BH], gl.float32, layout=row_l)
    acc = gl.zeros([BH, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BH, BLOCK_K], gl.float32, layout=s_layout)

    n_blocks = gl.cdiv(K, BLOCK_K)
    for j in range(0, n_blocks):
        stage = j % STAGES
        kv_buf = kv_smem.index(stage)
        # Block j has landed (this thread's copies); make every thread's copies
        # visible to the tensor cores, and make sure block j-1's wgmmas are done in
        # both warp groups before its ring slot is refilled.
        cp.wait_group(STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()
        nxt = j + STAGES - 1
        if BENCH_GATHER:  # (False: a benchmark diagnostic, the loop timed without gathers)
            _issue_kv_block(kv_smem.index(nxt % STAGES), KV, ids_gather, N, stride_kvn, offs_d)
        cp.commit_group()
        ids_gather = _load_ids(idx_row, (nxt + 1) * BLOCK_K, K, offs_r)

        s = warpgroup_mma(q_smem, kv_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        ids = ids_soft
        ids_soft = _load_ids(idx_row, (j + 1) * BLOCK_K, K, offs_c)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

        valid = (ids >= 0) & (ids < N)
        s = gl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new

        p_smem.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(p_smem, kv_buf, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    cp.wait_group(0)  # drain the (masked) copies issued past the end

    h_row = pid_h * BH + gl.arange(0, BH, layout=row_l)
    h_mask = h_row < H
    if HAS_SINK:
        sink = gl.load(SINK + h_row, mask=h_mask, other=0.0) * 1.4426950408889634
        m_f = gl.maximum(m_i, sink)
        rescale = gl.exp2(m_i - m_f)
        l_f = l_i * rescale + gl.exp2(sink - m_f)
    else:
        m_f = m_i
        rescale = gl.full([BH], 1.0, gl.float32, layout=row_l)
        l_f = l_i
    nonempty = l_f > 0.0
    w = gl.where(nonempty, rescale / gl.where(nonempty, l_f, 1.0), 0.0)
    lse = gl.where(nonempty, (m_f + gl.log2(gl.where(nonempty, l_f, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    gl.store(LSE + pid_t * stride_lt + h_row, lse, mask=h_mask)

    out = acc * gl.convert_layout(w, gl.SliceLayout(1, o_layout))[:, None]
    h_o = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, o_layout))
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = OUT + pid_t * stride_ot + h_o[:, None].to(gl.int64) * stride_oh + d_o[None, :]
    gl.store(o_ptrs, out.to(dtype), mask=(h_o < H)[:, None])


def supported(q: torch.Tensor, D: int, H: int) -> bool:
    """The Gluon kernel takes bf16/fp16 CUDA tensors on sm_90, D = 512 and H >= 64
    (below 64 heads a 64-row wgmma block is mostly padding; the Triton kernel is used)."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and D == 512 and H >= 64):
        return False
    props = cuda_properties(q.device)
    return (props.major, props.minor) == (9, 0)


def sparse_mla_fwd(q, kv, indices, attn_sink, scale, out=None, lse=None, BLOCK_K=64, STAGES=2,
                   **variant):
    """Launch the Gluon forward (same contract as ``forward.sparse_mla_fwd``)."""
    assert STAGES >= 2, "the ring needs two slots: one landing while the other is read"
    out, lse, args = prepare_forward(q, kv, indices, attn_sink, scale, out, lse)
    if args is None:
        return out, lse
    T, H, D = q.shape
    _sparse_mla_fwd_gluon_kernel[(T, triton.cdiv(H, BLOCK_H))](
        *args,
        D=D, BLOCK_K=BLOCK_K, STAGES=STAGES, HAS_SINK=attn_sink is not None,
        num_warps=NUM_WARPS, **variant,
    )
    return out, lse
