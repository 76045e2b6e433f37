"""Gluon forward of sparse MLA for Hopper (sm_90), D = 512 or the 576/512 layout (``ROPE``):
warp-specialised, persistent.

Same math and contract as ``forward_triton.py`` (the Triton kernel). One program per SM walks
the (token, 64-head block) tiles. Three partitions of one warp group each:

- the producer loads each tile's q, then gathers the kv rows of every 64-slot block
  with cp.async into two ring buffers, each split into D halves so that a half is
  refilled as soon as its last reader is done; mbarriers signal both ways. It loads the
  next tile's q as soon as this tile's last S has read q, so that the load overlaps
  the tile's last PV products and its epilogue.
- consumer 0 computes S = Q KV^T for the even blocks, consumer 1 for the odd ones,
  each as one full 64 x 64 wgmma (N = 64 is tensor-bound; splitting one block's S
  between the warp groups by columns, N = 32, was shared-memory bound);
- both consumers apply every block's P to their half of the output (consumer 0 owns
  D[0:256], consumer 1 D[256:512]): P and the running row max go through shared
  memory, so one consumer's softmax overlaps the other's tensor work.

The running max is one sequence m_0 <= m_1 <= ... that both consumers follow: block
j's softmax starts from m_{j-1}, published by the other consumer with P_{j-1}; each
consumer rescales its half of O (and its share of the row sum) to m_j before adding
P_j V_j, and the shares are summed at the end of the tile.

The 576/512 layout (``ROPE`` = 64: q and kv rows of 576 columns, the last 64 in the scores
only, out of 512): the kv blocks' 64 score-only columns go to a ring of their own (2 x 8 KB),
q's to each consumer's registers (the A operand of one more wgmma in S), and the output's
layout conversion goes through the consumer's P buffer instead of compiler scratch, which
pays for the new ring (docs/performance/forward.md#the-576512-layout-in-gluon: 0.96-1.00 of
the D = 512 TFLOPS on the H200). The D = 512 build is unchanged.

Gluon has no interpreter: tested on the GPU (tests/test_kernels_gpu.py) and compiled
for sm_90 in CI (tests/test_sm90_compile.py). Measurements: docs/performance/forward.md#gluon-forward.
"""
from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy as cp,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import aligned16, cuda_properties, trailing_lengths
from .forward_triton import FWD_RUNTIME_INTS, prepare_forward
from .hopper import (MAXNREG, NUM_WARPS, PARTITION_REGS, PARTITION_WARPS, async_load, balanced_order,
                     finish_softmax, fresh, fresh_zero, hopper_rejects, load_ids, thread_barrier,
                     tile_token)

BLOCK_H = 64
BLOCK_K = 64  # slots of a block

# mbarrier slots
_Q_READY = gl.constexpr(0)
_KV_READY = gl.constexpr(1)  # + 2 * buffer + half
_KV_FREE = gl.constexpr(5)  # + 2 * buffer + half
_P_READY = gl.constexpr(9)  # + buffer
_P_FREE = gl.constexpr(11)  # + buffer
_FIN = gl.constexpr(13)
_Q_FREE = gl.constexpr(14)
_N_BARS = gl.constexpr(15)
_DH = gl.constexpr(256)  # D / 2: D = 512 only
_BK = gl.constexpr(BLOCK_K)  # slots of a block
_BH = gl.constexpr(BLOCK_H)  # heads of a tile


@gluon.jit
def _producer(io, sizes, strides, smem, n_pairs, HAS_LEN: gl.constexpr):
    q_smem, kv_smem, bars = smem
    _produce(io, sizes, strides, (q_smem, kv_smem, kv_smem, bars), n_pairs, HAS_LEN, 0)


@gluon.jit
def _producer_rope(io, sizes, strides, smem, n_pairs, HAS_LEN: gl.constexpr):
    _produce(io, sizes, strides, smem, n_pairs, HAS_LEN, 64)


@gluon.jit
def _produce(io, sizes, strides, smem, n_pairs, HAS_LEN: gl.constexpr, ROPE: gl.constexpr):
    # (ROPE arrives as a literal from _producer / _producer_rope, as in backward_gluon: a
    # constexpr passed through warp_specialize's argument tuple reaches the default
    # partition as a plain value)
    Q, KV, IDX, LEN, ORDER = io
    T, H, N, K = sizes
    stride_qt, stride_qh, stride_kvn, stride_it = strides
    q_smem, kv_smem, kvr_smem, bars = smem
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs_d = gl.arange(0, _DH, layout=gl.SliceLayout(0, ld))
    offs_r = gl.arange(0, _BK, layout=gl.SliceLayout(1, ld))
    n_hb = gl.cdiv(H, _BH)
    n_tiles = T * n_hb
    tcount = 0
    pcount = 0  # block pairs gathered so far (the ring's phases)
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        pid_t = tile_token(ORDER, tile // n_hb, HAS_LEN)
        pid_h = tile % n_hb
        k_end, n_pairs_t, pair0 = _tile_pairs(LEN, pid_t, K, n_pairs, tcount, pcount, HAS_LEN)
        # q of this tile, once both consumers' last S of the previous tile is done (a
        # fresh mbarrier counts its phase "1" as complete: the first wait passes).
        mbarrier.wait(bars.index(_Q_FREE), (tcount & 1) ^ 1)
        h_ld = pid_h * _BH + gl.arange(0, _BH, layout=gl.SliceLayout(1, ld))
        q_ptrs = Q + pid_t * stride_qt + h_ld[:, None].to(gl.int64) * stride_qh + offs_d[None, :]
        h_ok = (h_ld < H)[:, None]
        async_load(q_smem.index(0), q_ptrs, mask=h_ok)
        async_load(q_smem.index(1), q_ptrs + _DH, mask=h_ok)
        cp.mbarrier_arrive(bars.index(_Q_READY), increment_count=False)
        idx_row = IDX + pid_t * stride_it
        _produce_tile(KV, idx_row, N, k_end, stride_kvn, kv_smem, bars, n_pairs_t, pair0, offs_r, offs_d,
                      HAS_LEN, kvr_smem, ROPE)
        tcount += 1
        pcount += n_pairs_t


@gluon.jit
def _tile_pairs(LEN, pid_t, K, n_pairs, tcount, pcount, HAS_LEN: gl.constexpr):
    """A tile's slot count, its 64-slot block pairs and the pairs before it (the ring's
    phases): K, ``n_pairs`` and ``tcount * n_pairs`` without lengths; with them, the token's
    length clamped to [0, K] and the running count ``pcount`` (tiles differ)."""
    if HAS_LEN:
        # (.to: without lengths LEN is a dummy pointer, the ids, which may be int64; the
        # branch is still type-checked)
        k_end = gl.minimum(gl.maximum(gl.load(LEN + pid_t).to(gl.int32), 0), K)
        n_pairs_t = gl.cdiv(gl.cdiv(k_end, _BK), 2)
        pair0 = pcount
    else:
        k_end = K
        n_pairs_t = n_pairs
        pair0 = tcount * n_pairs
    return k_end, n_pairs_t, pair0


@gluon.jit
def _produce_tile(KV, idx_row, N, K, stride_kvn, kv_smem, bars, n_pairs, pair0, offs_r, offs_d,
                  HAS_LEN: gl.constexpr, kvr_smem, ROPE: gl.constexpr):
    """Gather the kv rows of one tile's blocks into the ring (``pair0``: pairs gathered
    before; ``K``: the tile's slot count, ids past it masked). ``ROPE`` > 0: also the
    block's score-only columns [2 * _DH, 2 * _DH + ROPE) into ``kvr_smem[buffer]``, with
    D half 1 (its barriers cover them: see _consume_pair)."""
    ids = load_ids(idx_row, 0, K, offs_r)
    if ROPE > 0:  # (the value loads' layout: 64 columns are one repetition of it)
        offs_rd = 2 * _DH + gl.arange(0, ROPE, layout=offs_d.type.layout)
    for j in range(0, 2 * n_pairs):
        b = j % 2
        free_phase = ((pair0 + j // 2) & 1) ^ 1
        ids64 = ids.to(gl.int64)
        valid = (ids64 >= 0) & (ids64 < N)
        rows = gl.where(valid, ids64, 0)  # masked ids never form an address
        ptrs = KV + rows[:, None] * stride_kvn + offs_d[None, :]
        vm = valid[:, None]
        ids = load_ids(idx_row, (j + 1) * _BK, K, offs_r)  # next block's ids, ahead
        for half in gl.static_range(2):
            mbarrier.wait(bars.index(_KV_FREE + 2 * b + half), free_phase)
            if j * _BK < K:  # (a block past the length or K: no reader)
                async_load(kv_smem.index(2 * b + half), ptrs + half * _DH, mask=vm)
                if ROPE > 0 and half == 1:
                    async_load(kvr_smem.index(b), KV + rows[:, None] * stride_kvn + offs_rd[None, :], mask=vm)
            cp.mbarrier_arrive(bars.index(_KV_READY + 2 * b + half), increment_count=False)


@gluon.jit
def _softmax_block(s, ids, N, m_cur, l_i, scale_log2):
    """Online softmax of one S block from the running max ``m_cur``: (P, m_new, alpha, l)."""
    valid = (ids >= 0) & (ids < N)
    s = gl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_cur, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_cur - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, alpha, l_i


@gluon.jit
def _rescale_to(m_cur, m_new):
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    return gl.exp2(m_cur - m_safe)


@gluon.jit
def _take_max(m_smem, slot: gl.constexpr, m_cur, l_i, acc):
    """The other consumer's running max (published in ``slot``): my half of O and my share
    of the row sum rescaled to it. Returns (m, l_i, acc)."""
    m_new = m_smem.index(slot).load(m_cur.type.layout)
    alpha = _rescale_to(m_cur, m_new)
    return m_new, l_i * alpha, acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _consumer(args, WG: gl.constexpr, HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr, ROPE: gl.constexpr = 0,
              rope_io=0, DEAD: gl.constexpr = False):
    """Consumer ``WG`` (0 or 1): S of blocks j = WG mod 2, O[:, WG*DH:(WG+1)*DH] of every block.
    ``ROPE`` > 0 (the 576/512 layout): ``rope_io`` is (Q, stride_qt, stride_qh, kvr_smem).
    ``DEAD``: a tile's last pair may have its odd block wholly past the tile's slots (with
    lengths, or K % 128 in [1, 64]), which both consumers then skip."""
    io, sizes, strides, smem, n_pairs, scale_log2 = args
    T, H, N, K = sizes
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, _BK, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)

    offs_c = gl.arange(0, _BK, layout=col_l)
    s_zero = gl.zeros([_BH, _BK], gl.float32, layout=s_layout)
    LEN = io[4]
    ORDER = io[5]
    n_hb = gl.cdiv(H, _BH)
    n_tiles = T * n_hb
    tcount = 0
    pcount = 0  # block pairs consumed so far (the ring's phases)
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        pid_t = tile_token(ORDER, tile // n_hb, HAS_LEN)
        pid_h = tile % n_hb
        k_end, n_pairs_t, pair0 = _tile_pairs(LEN, pid_t, K, n_pairs, tcount, pcount, HAS_LEN)
        _consume_tile(io, sizes, strides, smem, n_pairs_t, scale_log2, pid_t, pid_h, tcount, pair0, k_end,
                      offs_c, s_zero, WG, HAS_SINK, HAS_LEN, ROPE, rope_io, DEAD)
        tcount += 1
        pcount += n_pairs_t


@gluon.jit
def _consume_pair(smem, pair, acc, l_i, m_cur, ids, WG: gl.constexpr, DEAD: gl.constexpr,
                  ROPE: gl.constexpr = 0, rope=0):
    """Block pair ``i`` of a tile for consumer ``WG``: S and P of block 2i + WG, both
    blocks' P V on this consumer's D half. Returns (acc, l_i, m_cur, ids). ``ROPE`` > 0:
    ``rope`` is (q's score-only columns in registers, the ring's kv score-only columns)."""
    q_smem, kv_smem, p_smem, m_smem, l_smem, bars = smem
    i, ph, n_pairs, idx_row, N, K, scale_log2, offs_c, s_zero = pair
    BK: gl.constexpr = _BK
    dtype: gl.constexpr = q_smem.dtype
    orow_l: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    # z is 0 (grid z = 1) but unknown to the compiler: the shared-memory descriptors
    # are formed in the loop instead of hoisted out of it and spilled.
    z = i * gl.program_id(2)
    mine = kv_smem.index(2 * WG + fresh(z))
    mine_hi = kv_smem.index(2 * WG + 1 + fresh(z))
    if ROPE > 0:
        # My block's ids (the softmax's mask), loaded now rather than a pair ahead: the
        # wait for the block and its S hide the load, and the 16 registers a thread of a
        # second set of ids, live across the whole pair, are what q's score-only columns
        # need.
        my_ids = load_ids(idx_row, (2 * i + WG) * BK, K, offs_c)
    # S of my block (2i + WG): both D halves of my buffer.
    # (the first D half's product starts while the second half is still landing)
    mbarrier.wait(bars.index(_KV_READY + 2 * WG), ph)
    fence_async_shared()
    s = warpgroup_mma(q_smem.index(fresh(z)), mine.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(bars.index(_KV_READY + 2 * WG + 1), ph)
    fence_async_shared()
    s = warpgroup_mma(q_smem.index(fresh(z) + 1), mine_hi.permute((1, 0)), s, is_async=True)
    if ROPE > 0:
        # The score-only columns: q's from registers (the wgmma's A operand), the block's
        # from shared memory; gathered with D half 1, whose barrier was waited just above.
        # Half 1 of my buffer is freed only after my S is done (buffer 0: consumer 1's
        # P_0 V on half 1 follows P_0, which follows this S; buffer 1: consumer 1 frees it
        # after its own S and P V), so they stay in place until S has read them.
        qr, kvr_smem = rope
        s = warpgroup_mma(qr, kvr_smem.index(WG + z).permute((1, 0)), s, is_async=True)
    else:
        my_ids = ids
        ids = load_ids(idx_row, (2 * i + 2 + WG) * BK, K, offs_c)

    if WG == 1:
        # Block 2i (consumer 0's): its max is my starting point; apply its P to my half
        # while my S runs.
        mbarrier.wait(bars.index(_P_READY + 0), ph)
        m_cur, l_i, acc = _take_max(m_smem, 0, m_cur, l_i, acc)
        mbarrier.wait(bars.index(_KV_READY + 1), ph)
        acc = warpgroup_mma(p_smem.index(fresh_zero(z)), kv_smem.index(1 + fresh_zero(z)), acc,
                            is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    else:
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    # After the tile's last S, q may be replaced by the next tile's.
    mbarrier.arrive(bars.index(_Q_FREE), pred=i == n_pairs - 1)

    p, m_new, alpha, l_i = _softmax_block(s, my_ids, N, m_cur, l_i, scale_log2)
    # Publish P and the new running max (once the other consumer is done with the
    # previous P in this slot).
    mbarrier.wait(bars.index(_P_FREE + WG), ph ^ 1)
    p_smem.index(WG).store(p.to(dtype))
    m_smem.index(WG).store(m_new)
    fence_async_shared()
    mbarrier.arrive(bars.index(_P_READY + WG))

    if WG == 1:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(bars.index(_KV_FREE + 1))  # buffer 0, D half 1: S and both PVs done
        mbarrier.arrive(bars.index(_P_FREE + 0))
    acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
    m_cur = m_new
    acc = warpgroup_mma(p_smem.index(WG + fresh_zero(z)), kv_smem.index(2 * WG + WG + fresh_zero(z)), acc,
                        is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    if WG == 0:
        mbarrier.arrive(bars.index(_KV_FREE + 0))  # buffer 0, D half 0
        # Block 2i + 1 (consumer 1's): rescale to its max, apply its P to my half.
        mbarrier.wait(bars.index(_P_READY + 1), ph)
        m_cur, l_i, acc = _take_max(m_smem, 1, m_cur, l_i, acc)
        mbarrier.wait(bars.index(_KV_READY + 2), ph)
        if (not DEAD) or (2 * i + 1) * BK < K:  # (an odd block past the slots: skipped, P = 0)
            acc = warpgroup_mma(p_smem.index(1 + fresh_zero(z)), kv_smem.index(2 + fresh_zero(z)), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(bars.index(_KV_FREE + 2))  # buffer 1, D half 0
        mbarrier.arrive(bars.index(_P_FREE + 1))
    else:
        mbarrier.arrive(bars.index(_KV_FREE + 3))  # buffer 1, D half 1
    return acc, l_i, m_cur, ids


@gluon.jit
def _consume_dead_odd_block(smem, pair, acc, l_i, m_cur, ids):
    """Consumer 1's side of a pair whose odd block lies past the token's length (lengths
    only): block 2i's P V as in ``_consume_pair``, then no S, no P and no P V for block
    2i + 1, only the hand-offs that keep every barrier's phase (its max, unchanged, goes to
    consumer 0, which skips that block's P V too). Returns (acc, l_i, m_cur, ids)."""
    q_smem, kv_smem, p_smem, m_smem, l_smem, bars = smem
    i, ph, n_pairs, idx_row, N, K, scale_log2, offs_c, s_zero = pair
    mbarrier.wait(bars.index(_KV_READY + 2), ph)  # (nothing gathered: phases only)
    mbarrier.wait(bars.index(_KV_READY + 3), ph)
    mbarrier.wait(bars.index(_P_READY + 0), ph)
    m_cur, l_i, acc = _take_max(m_smem, 0, m_cur, l_i, acc)
    mbarrier.wait(bars.index(_KV_READY + 1), ph)
    acc = warpgroup_mma(p_smem.index(0), kv_smem.index(1), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(bars.index(_Q_FREE), pred=i == n_pairs - 1)
    mbarrier.wait(bars.index(_P_FREE + 1), ph ^ 1)
    m_smem.index(1).store(m_cur)
    fence_async_shared()
    mbarrier.arrive(bars.index(_P_READY + 1))
    mbarrier.arrive(bars.index(_KV_FREE + 1))
    mbarrier.arrive(bars.index(_P_FREE + 0))
    mbarrier.arrive(bars.index(_KV_FREE + 3))
    return acc, l_i, m_cur, ids


@gluon.jit
def _consume_tile(io, sizes, strides, smem, n_pairs, scale_log2, pid_t, pid_h, tcount, pair0, K, offs_c,
                  s_zero, WG: gl.constexpr, HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr,
                  ROPE: gl.constexpr = 0, rope_io=0, DEAD: gl.constexpr = False):
    """One (token, 64-head block) tile of consumer ``WG``: ``n_pairs`` block pairs, the
    first of them the ring's ``pair0``-th, ids past slot ``K`` masked."""
    IDX, SINK, OUT, LSE, LEN, ORDER = io
    T, H, N, _ = sizes
    stride_it, stride_ot, stride_oh, stride_lt = strides
    q_smem, kv_smem, p_smem, m_smem, l_smem, bars = smem
    BH: gl.constexpr = _BH
    DH: gl.constexpr = _DH
    BK: gl.constexpr = _BK
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = s_zero.type.layout
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DH, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    idx_row = IDX + pid_t * stride_it
    if ROPE > 0:
        ids = 0  # (each pair loads its own: _consume_pair)
    else:
        ids = load_ids(idx_row, WG * BK, K, offs_c)
    m_cur = gl.full([BH], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([BH], gl.float32, layout=row_l)
    acc = gl.zeros([BH, DH], gl.float32, layout=o_layout)
    if ROPE > 0:
        # q's 64 score-only columns of this tile, straight into registers in the layout of
        # the wgmma's A operand (16 registers a thread; no room for them in shared memory).
        # Issued before the q wait, so the load's latency hides behind it.
        Q, stride_qt, stride_qh, kvr_smem = rope_io
        qr_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        h_q = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, qr_l))
        c_q = 2 * DH + gl.arange(0, ROPE, layout=gl.SliceLayout(0, qr_l))
        qr_ptrs = Q + pid_t * stride_qt + h_q[:, None].to(gl.int64) * stride_qh + c_q[None, :]
        qr = gl.load(qr_ptrs, mask=(h_q < H)[:, None], other=0.0)
        rope = (qr, kvr_smem)
    else:
        rope = 0

    mbarrier.wait(bars.index(_Q_READY), tcount & 1)
    for i in range(0, n_pairs):
        ph = (pair0 + i) & 1
        pair = (i, ph, n_pairs, idx_row, N, K, scale_log2, offs_c, s_zero)
        if DEAD and WG == 1:
            if (2 * i + 1) * BK < K:
                acc, l_i, m_cur, ids = _consume_pair(smem, pair, acc, l_i, m_cur, ids, WG, DEAD, ROPE, rope)
            else:  # the pair's odd block is all past the tile's slots
                acc, l_i, m_cur, ids = _consume_dead_odd_block(smem, pair, acc, l_i, m_cur, ids)
        else:
            acc, l_i, m_cur, ids = _consume_pair(smem, pair, acc, l_i, m_cur, ids, WG, DEAD, ROPE, rope)

    mbarrier.arrive(bars.index(_Q_FREE), pred=n_pairs == 0)  # K = 0: no S read q

    # Both consumers now hold O halves and row-sum shares relative to the same max.
    l_smem.index(WG).store(l_i)
    mbarrier.arrive(bars.index(_FIN))
    mbarrier.wait(bars.index(_FIN), tcount & 1)
    l_tot = l_smem.index(0).load(row_l) + l_smem.index(1).load(row_l)

    h_row = pid_h * BH + gl.arange(0, BH, layout=row_l)
    h_mask = h_row < H
    if HAS_SINK:
        sink2 = gl.load(SINK + h_row, mask=h_mask, other=0.0) * 1.4426950408889634
    else:
        sink2 = m_cur  # unused
    w, lse = finish_softmax(m_cur, l_tot, sink2, HAS_SINK)
    if WG == 0:
        gl.store(LSE + pid_t * stride_lt + h_row, lse, mask=h_mask)

    out = (acc * gl.convert_layout(w, orow_l)[:, None]).to(dtype)
    # Stored from a row-contiguous layout (16 bytes a thread): from the wgmma layout each
    # store instruction would write 8 rows x 16 bytes. Converted a quarter at a time
    # (column bits 6-7 are register bits of the wgmma layout), so the conversion's
    # shared-memory scratch is 8 KB, not 32.
    st_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    # column = 128 * c2 + 64 * c1 + c0 -> [row, c0, c2, c1]; split c1, then c2
    q4 = out.reshape([BH, 2, 2, DH // 4]).permute((0, 3, 1, 2))
    even, odd = q4.split()  # c1 = 0 (columns 0-63, 128-191), c1 = 1 (64-127, 192-255)
    o0, o2 = even.split()
    o1, o3 = odd.split()
    h_o = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, st_l))
    d_o = WG * DH + gl.arange(0, DH // 4, layout=gl.SliceLayout(0, st_l))
    o_ptrs = OUT + pid_t * stride_ot + h_o[:, None].to(gl.int64) * stride_oh + d_o[None, :]
    h_ok = (h_o < H)[:, None]
    if ROPE > 0:
        # No room for the conversion's scratch (8 KB per consumer): the quarters go through
        # my own P buffer instead. After _FIN its last reader, the other consumer's P V, is
        # done, and its next writer is me, at my next tile's first P.
        scr = p_smem.index(WG)
        _store_quarter(scr, o0, o_ptrs, h_ok, st_l)
        _store_quarter(scr, o1, o_ptrs + DH // 4, h_ok, st_l)
        _store_quarter(scr, o2, o_ptrs + 2 * (DH // 4), h_ok, st_l)
        _store_quarter(scr, o3, o_ptrs + 3 * (DH // 4), h_ok, st_l)
    else:
        gl.store(o_ptrs, gl.convert_layout(o0, st_l), mask=h_ok)
        gl.store(o_ptrs + DH // 4, gl.convert_layout(o1, st_l), mask=h_ok)
        gl.store(o_ptrs + 2 * (DH // 4), gl.convert_layout(o2, st_l), mask=h_ok)
        gl.store(o_ptrs + 3 * (DH // 4), gl.convert_layout(o3, st_l), mask=h_ok)


@gluon.jit
def _store_quarter(scr, o, o_ptrs, h_ok, st_l: gl.constexpr):
    """Store a [64, 64] output quarter from a row-contiguous layout, converted through the
    shared buffer ``scr`` (the warp group's barriers: every thread's part is in before any
    is read, and read before the next quarter or the next P overwrites it)."""
    scr.store(o)
    thread_barrier()
    gl.store(o_ptrs, scr.load(st_l), mask=h_ok)
    thread_barrier()


@gluon.jit(do_not_specialize=FWD_RUNTIME_INTS)
def _sparse_mla_fwd_gluon_kernel(
    Q, KV, IDX, SINK, OUT, LSE,
    T, H, N, K,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt,
    scale_log2, LEN, ORDER,
    D: gl.constexpr,
    HAS_SINK: gl.constexpr,
    HAS_LEN: gl.constexpr,
    ROPE: gl.constexpr = 0,
    DEAD: gl.constexpr = False,
):
    gl.static_assert(D == 2 * _DH, "the Gluon forward takes D = 512 value columns")
    gl.static_assert(ROPE == 0 or ROPE == 64, "score-only columns: none or 64 (the 576/512 layout)")
    BH: gl.constexpr = _BH
    BK: gl.constexpr = _BK
    DH: gl.constexpr = _DH
    dtype: gl.constexpr = Q.dtype.element_ty
    half_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, DH], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BK], dtype)
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_smem = gl.allocate_shared_memory(dtype, [2, BH, DH], half_sl)
    kv_smem = gl.allocate_shared_memory(dtype, [4, BK, DH], half_sl)  # [buffer * 2 + D half]
    p_smem = gl.allocate_shared_memory(dtype, [2, BH, BK], p_sl)
    m_smem = gl.allocate_shared_memory(gl.float32, [2, BH], v_sl)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, BH], v_sl)
    bars = gl.allocate_shared_memory(gl.int64, [_N_BARS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(_Q_READY), count=128)  # cp.async arrivals of the producer's threads
    for i in gl.static_range(4):
        mbarrier.init(bars.index(_KV_READY + i), count=128)
        mbarrier.init(bars.index(_KV_FREE + i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(bars.index(_P_READY + i), count=1)
        mbarrier.init(bars.index(_P_FREE + i), count=1)
    mbarrier.init(bars.index(_FIN), count=2)
    mbarrier.init(bars.index(_Q_FREE), count=2)

    n_pairs = gl.cdiv(gl.cdiv(K, BK), 2)
    sizes = (T, H, N, K)
    c_args = ((IDX, SINK, OUT, LSE, LEN, ORDER), sizes, (stride_it, stride_ot, stride_oh, stride_lt),
              (q_smem, kv_smem, p_smem, m_smem, l_smem, bars), n_pairs, scale_log2)
    # The producer is the default partition: ptxas compiles it under the kernel's
    # register limit (MAXNREG), the consumers under their own (setmaxnreg).
    if ROPE > 0:
        # The 576/512 layout: the kv blocks' score-only columns in a ring of their own
        # (2 x 8 KB), q's in the consumers' registers, and the output conversion through
        # the P buffers (docs/performance/forward.md#the-576512-layout-in-gluon).
        kvr_smem = gl.allocate_shared_memory(dtype, [2, BK, ROPE], p_sl)  # [buffer]
        p_args = ((Q, KV, IDX, LEN, ORDER), sizes, (stride_qt, stride_qh, stride_kvn, stride_it),
                  (q_smem, kv_smem, kvr_smem, bars), n_pairs, HAS_LEN)
        rope_io = (Q, stride_qt, stride_qh, kvr_smem)
        gl.warp_specialize([(_producer_rope, p_args),
                            (_consumer, (c_args, 0, HAS_SINK, HAS_LEN, ROPE, rope_io, DEAD)),
                            (_consumer, (c_args, 1, HAS_SINK, HAS_LEN, ROPE, rope_io, DEAD))],
                           [PARTITION_WARPS, PARTITION_WARPS], [PARTITION_REGS, PARTITION_REGS])
    else:
        p_args = ((Q, KV, IDX, LEN, ORDER), sizes, (stride_qt, stride_qh, stride_kvn, stride_it),
                  (q_smem, kv_smem, bars), n_pairs, HAS_LEN)
        gl.warp_specialize([(_producer, p_args), (_consumer, (c_args, 0, HAS_SINK, HAS_LEN, 0, 0, DEAD)),
                            (_consumer, (c_args, 1, HAS_SINK, HAS_LEN, 0, 0, DEAD))],
                           [PARTITION_WARPS, PARTITION_WARPS], [PARTITION_REGS, PARTITION_REGS])


NAME = "gluon_sm90"
# Without lengths, the tiles leave out each token's trailing masked slots: a launch before
# the kernel finds them (``common.trailing_lengths``) and the kernel takes them as lengths
# in token order (``HAS_LEN`` 2: no balanced order). A causal indexer's ids end in -1 until
# its pool fills. Off: -10% / -31% with causal ids at H64 K640 / H128 K1152, but up to
# +7% where every slot is valid (H100, T = 4096: docs/performance/forward.md#trailing-masked-slots).
TRAILING_MASKED_SKIPPED = False
# Skip a tile's last odd block where it lies wholly past K (K % 128 in [1, 64]: K = 160
# ran its 3 blocks as 4) or past a token's length; False: compute it, masked (A/B runs).
SKIP_DEAD_ODD_BLOCK = True


def dead_odd_block(K: int, has_len: bool) -> bool:
    """The ``DEAD`` build: whether a tile's last block pair can have its odd block wholly
    past the tile's slots (with lengths always; without, where 0 < K % 128 <= 64)."""
    return has_len or (SKIP_DEAD_ODD_BLOCK and 0 < K % (2 * BLOCK_K) <= BLOCK_K)


# Fewest heads for which this is the faster forward (H200, T=4096, K=1152 and 512): from
# H = 24 it takes 26-57% less time than the Triton kernel; at H <= 16 its 64-row tiles are
# mostly padding and Triton's 16-row blocks win by 2-4%
# (docs/performance/forward.md#which-forward-below-64-heads).
MIN_HEADS = 17


def rejects(call) -> str | None:
    """Why this kernel does not run ``call``'s forward (None: it does). Its whole rule:
    ``hopper.hopper_rejects`` (a Triton with Gluon's Hopper API, an sm_90 GPU, bf16/fp16,
    D = 512, or the 576/512 layout: D = 576 with d_v = 512) and H >= MIN_HEADS (fewer heads
    than a 64-row tile are masked rows).

    The 576/512 layout under every Triton: under 3.9 its ptxas reloads one spilled value
    (the shared-memory base) in every block loop of this build (tests/test_sm90_compile.py),
    which costs less than the Triton kernel's half speed
    (docs/performance/forward.md#the-576512-layout-in-gluon).
    """
    reason = hopper_rejects(call, v32=True)
    if reason:
        return reason
    if call.H < MIN_HEADS:
        return f"H={call.H} heads (takes H >= {MIN_HEADS}; below, the Triton kernel is faster)"
    return None


def sparse_mla_fwd(q, kv, indices, attn_sink, scale, out=None, lse=None, topk_length=None, d_v=None):
    """Launch the Gluon forward (same contract as ``forward_triton.sparse_mla_fwd``): D = 512,
    or D = 576 with ``d_v`` = 512 (the last 64 columns of q and kv score only; out is
    [T, H, 512]). With ``topk_length`` each tile visits the 128-slot block pairs that hold
    its token's slots."""
    dv = q.shape[-1] if d_v is None else d_v
    if (q.shape[-1], dv) not in ((512, 512), (576, 512)):
        raise ValueError(f"forward_gluon: takes D = 512, or D = 576 with d_v = 512 (got D = {q.shape[-1]}, "
                         f"d_v = {dv}; see rejects)")
    q, kv = aligned16(q), aligned16(kv)  # (rows gathered by 16-byte cp.async)
    out, lse, args = prepare_forward(q, kv, indices, attn_sink, scale, out, lse, d_v)
    if args is None:
        return out, lse
    T, H, D = q.shape
    n_tiles = T * triton.cdiv(H, BLOCK_H)
    # Persistent: one program per SM walks the (token, head block) tiles, so the next
    # tile's q and first kv blocks load while this tile finishes.
    grid = (min(n_tiles, cuda_properties(q.device).multi_processor_count),)
    # With lengths the tiles differ in work: the programs take the tokens in an order that
    # balances them (the static round robin would otherwise decide the slowest program).
    # The trailing lengths follow the token order already: consecutive tokens, alike lengths.
    trailing = topk_length is None and TRAILING_MASKED_SKIPPED
    if trailing:
        topk_length = trailing_lengths(indices, kv.shape[0])
    order = balanced_order(topk_length, T, grid[0], triton.cdiv(H, BLOCK_H)) \
        if topk_length is not None and not trailing else None
    _sparse_mla_fwd_gluon_kernel[grid](
        *args, topk_length if topk_length is not None else indices, order if order is not None else indices,
        # (HAS_LEN 2: lengths in token order; the default builds keep their bool key)
        D=dv, HAS_SINK=attn_sink is not None, HAS_LEN=2 if trailing else topk_length is not None, ROPE=D - dv,
        DEAD=dead_odd_block(indices.shape[1], topk_length is not None),
        num_warps=NUM_WARPS, maxnreg=MAXNREG,
    )
    return out, lse
