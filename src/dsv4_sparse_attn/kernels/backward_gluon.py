"""Gluon main kernel of the sparse-MLA backward for Hopper (sm_90), D = 512.

The main kernel of ``backward.py``'s backward (S, dP, dS, grad_q and the dKV rows; Delta,
the reductions and grad_sink are ``backward.py``'s). Warp-specialised and persistent:
one program per SM walks the (token, 64-head block) tiles of a token chunk, with three
partitions of one warp group each:

- the producer loads a tile's q and dO (64 heads x 512, in four D quarters) and
  gathers the kv rows of every 64-slot block with cp.async into one buffer in two D
  halves; mbarriers signal both ways;
- the two consumers take the blocks in turn (even blocks one, odd blocks the other):
  the owner of a block computes S = Q KV^T and dP = dO KV^T as full 64 x 64 wgmmas,
  then P and dS = P (dP - Delta) scale, which it publishes in shared memory (bf16, the
  precision the tensor cores take them in);
- both consumers then use every block's P and dS on their half of D: consumer c
  accumulates dQ[:, c*256:(c+1)*256] += dS KV (fp32, in registers for the whole tile),
  releases its kv half (the next block's gather starts), and forms the block's dKV rows
  for its half of D, 64 columns at a time: P^T dO + dS^T Q (M = 64 slots, K = 64
  heads), each piece sent off while the next one's wgmma runs.

The dKV rows go either (``RED``, the fast mode) straight into an fp32 [N, D]
accumulator with 16-byte vector reductions, in the fake column order of
``hopper.red_f32x4_fake``, a warp's instruction covering whole 128-byte lines
(``hopper.red_f32x4_lines``; masked slots add nothing), or (deterministic)
into per-(token, slot) partial rows that ``backward.py`` sums in a fixed order; with an
even number of head blocks one partial row serves a pair of them (``_consume_tile``).
A tile of H <= 32 heads in the fast mode runs every product transposed, the heads as the
wgmma's N (``_consume_tile_split_t``).
Organisation and measurements: docs/design.md#backward-gluon-hopper-dkv-accumulation,
docs/performance/backward.md#gluon-main-kernel.

Gluon has no interpreter: tested on the GPU (tests/test_kernels_gpu.py) and compiled
for sm_90 in CI (tests/test_sm90_compile.py).
"""
from __future__ import annotations

import torch
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

from .backward import DqParts, sum_dq_parts
from .common import cuda_properties
from .fold_gluon import (_FLAT1 as fold_flat1, _view as fold_view, fold_begin, fold_smem, fold_start,
                         fold_tiles)
from .hopper import (MAXNREG, NUM_WARPS, PARTITION_REGS, PARTITION_WARPS, TRITON_VERSION, TensorDescriptor,
                     async_load, balanced_order, fake_group_base, hopper_rejects, load_ids, red_f32x4_fake,
                     red_f32x4_lines, red_f32x4_lines_exact, red_f32x4_lines_grid, red_s32x2_lines,
                     st_bf16x4_fake, st_f16x4_fake, st_f32x4_fake, fresh, thread_barrier, tma_load, tma_store,
                     tma_store_wait)

NAME = "gluon_sm90"
# 16-bit partial rows (``backward.sparse_mla_bwd(partial16=...)``, the default where
# ``partial16_default``): ``launch`` takes ``partial_exp`` (D = 512 or 576/512, no head-block pairs)
PARTIAL_16 = True
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
BLOCK_H = 64  # heads of a tile (fewer heads: the tile's other rows are masked)
BLOCK_K = 64  # slots of a block: partial rows are padded to whole blocks
ACC_FAKE_ORDER = True  # dKV rows (accumulator and partial rows) are in fake column order
PARTIAL_BF16 = True  # ``launch`` takes bf16 partial rows (``backward.PARTIAL_16_BF16``, D = 512)
# The fast mode's reductions: whole 128-byte lines per instruction (hopper.red_f32x4_lines)
# or half lines (hopper.red_f32x4_fake); ``launch(lines=...)`` overrides it for A/B runs.
# Whole lines: 6-11% faster at T = 4096 on the H200 under Triton 3.6
# (docs/performance/backward.md#whole-lines-per-reduction).
RED_LINES = True
# The fast mode's whole-line reductions with an L2 evict-last policy where the fp32 [N, D]
# accumulator is at least EVICT_LAST_MIN_L2 times the L2 (``launch(evict_last=...)``
# overrides it). H200, four A, B passes: T = 131072 with causal ids (335 MB, 5.6x the L2)
# 2.6% less time at H64 K640 and at H128 K1152, every evict-last pass faster than every
# plain one; T = 32768 (84 MB) level; T = 4096 (10 MB) level to 1.5% slower
# (docs/performance/backward.md#l2-evict-last-on-the-reductions).
EVICT_LAST_MIN_L2 = 4
# The blocks' roles split in time (``_consume_tile_split``), both modes: the owner of a
# block also forms all of its dKV rows, while the other consumer computes the next block's
# S and dP; 2: with P and dS double-buffered (16 KB more shared memory). D = 512 value
# columns only (no score-only columns). Measured on the H200 under Triton 3.6
# (docs/performance/backward.md#split-roles): fast mode 1-5% less time with 2;
# deterministic mode 9-14% more at H = 128 (a head-block pair's programs wait on each other
# per block parity), off there;
# at one head block (H <= 64) split 1 (no second P/dS buffer) 1.4-3.2% less at K >= 640,
# with and without lengths (+1.0% / -0.6% at K = 160: off below SPLIT_DET_MIN_K), gradients
# bitwise equal. ``launch(split=...)`` overrides all three.
# This and the options below are on under the Tritons they were timed with (_TIMED): 3.6,
# and 3.8 and 3.9, whose runs of 2026-12-05 (d2011fb) found each of them as fast or faster
# than without (docs/performance/backward.md#defaults-by-triton-version-measured); not 3.7
# (torch 2.12), whose builds are as clean as 3.6's but were not timed.
_TIMED = TRITON_VERSION in ((3, 6), (3, 8), (3, 9))
_TRITON_39 = TRITON_VERSION >= (3, 9)
SPLIT_ROLES = 2 if _TIMED else 0
SPLIT_ROLES_DET = 0  # two or more head blocks
SPLIT_ROLES_DET_ONE_HB = 1 if _TIMED else 0  # one head block
SPLIT_DET_MIN_K = 512
# q and dO by TMA (``launch(qd_tma=...)``): the producer loads a tile's q and dO as eight
# [1, 64, 128] TMA tiles of [T, H, D] instead of 64 cp.async a thread, so that they do not
# queue behind the last block's reductions in the SM's load/store path (cuDNN loads Q and dO
# by TMA); heads past H come in as zeros, as the cp.async masks make them. Taken where TMA
# can address the tensors (the last dim contiguous, 16-byte aligned base and strides), D =
# 512 without score-only columns; else cp.async. Measured with the early release below
# (H200, Triton 3.6; docs/performance/backward.md#q-and-do-by-tma-and-their-early-release-measured):
# 3.5-6.6% less time where a tile has few blocks (K = 128-160), within the run's spread at
# K >= 512; so ``None`` (the default) takes it at K <= QD_TMA_MAX_K, under the Tritons it was
# timed with. (With dQ by TMA the early release below is off.)
QD_TMA = None
QD_TMA_MAX_K = 256 if _TIMED else -1
# With q and dO by TMA and a split schedule (``launch(qd_early=...)``, 0: off): the owner of
# a tile's last block releases the first QD_EARLY D quarters of q and dO (2 or 3) as soon as
# its dKV pieces are done with them, and the producer loads the next tile's quarters into
# them while the last block's remaining pieces run. (One release a block: a predicated
# mbarrier arrive per quarter made ptxas reload 23 spilled values a block loop under Triton
# 3.6, split 2, no lengths; one arrive, none.)
QD_EARLY = 2
# dQ staged in the tile's own q quarters and stored by TMA (``launch(dq_tma=...)``), not by
# 64 four-byte stores a thread from the wgmma layout: those queue in the SM's load/store
# path behind the last block's reductions, and without them a tile takes 5-11 us less
# (docs/performance/backward.md#a-tiles-fixed-cost-taken-apart). Not with the early
# release (the next tile's first quarters then land in q while the last block runs), so
# where dQ goes by TMA the early release is off. On where timed (_TIMED); 0 the plain
# stores. (Staging in the kv block's buffer instead, so that the next tile's q/dO load
# need not wait for it, measured 9-16% slower at K >= 512 and was removed:
# docs/performance/backward.md#dq-by-tma.)
DQ_TMA = 1 if _TIMED else 0
# The same with score-only columns (the 576/512 layout, unsplit schedule): the 512 value
# columns of dQ by TMA through q's quarters, the 64 rope columns from the scratch rows as
# before (``launch(dq_tma=...)`` sets both). Measured under 3.6 (H200, T = 4096): fast
# backward 0.2-4.6% less time, deterministic 0.2-2.1%, bitwise equal
# (docs/performance/backward.md#the-576512-layout-in-the-gluon-main-kernel).
DQ_TMA_ROPE = TRITON_VERSION == (3, 6)
# At H <= 16 or 32 the dKV products contract over 16 or 32 heads, not the tile's 64
# (``_head_pad``; ``launch(head_pad=...)``): the rows of P and dS past H are zeros.
# Measured on the H200 under Triton 3.6: 2.5-6.5% less time in both modes, deterministic
# gradients bitwise equal (docs/performance/backward.md#dkv-products-over-the-heads-a-tile-holds-kept).
HEAD_PAD = True
# The fast mode cuts the tiles past the last whole round of programs into parts of a few slot
# blocks, one a program (launch(split_remainder=...); _remainder_parts).
SPLIT_REMAINDER = True
# The fast mode's tiles of H <= 32 heads in a split schedule with their products transposed
# (``_consume_tile_split_t``: the heads as the wgmma's N; ``launch(transposed=...)``).
# Measured on the H200 under Triton 3.6: 3.1-6.0% less time than with HEAD_PAD alone
# (docs/performance/backward.md#small-head-tiles-transposed-kept); on where timed. (Not
# the deterministic mode: its build at H <= 16 serialises the wgmmas, sm_90, Triton 3.6.)
SMALL_H_TRANSPOSED = _TIMED
# Whether a launch without head-block pairs builds their code anyway (``_pairs_code``):
# None, the rule (left out under Triton 3.9 only, but for the deterministic 576/512 build);
# True or False forces it (``launch(pairs_code=...)`` for one launch).
PAIRS_CODE = None
# The deterministic mode's fold of the previous chunk in the producer (``backward.FOLD_IN_MAIN``,
# ``launch(fold=...)``): the consumers' registers then (the producer takes 3 x MAXNREG less
# both: 56 at 224; at 216 the consumers' block loops reload 98-107 values and serialise the
# wgmmas, sm_90, Triton 3.6: benchmarks/experiments/fold_in_producer_regs.py), and the ring's
# entries a tile and tiles (FOLD_TILE_ENTRIES x FOLD_STAGES x 1 KB a part: the shared memory
# the kernel leaves is about 18 KB), and tiles folded after each slot block's gathers.
FOLD_CONSUMER_REGS = gl.constexpr(224)
FOLD_TILE_ENTRIES = 8
FOLD_STAGES = 2
FOLD_TILES_A_BLOCK = 8
# Tiles past the ring's next one whose rows are prefetched into the L2 (0: none): a tile's
# cp.async then waits on the L2, not the HBM. Without it the fold's steps after each block
# outlasted the block (H100, T = 4096: H64 K640 4.93 ms against 3.63 shipped).
FOLD_L2_AHEAD = 4


# mbarrier slots
_QD_READY = gl.constexpr(0)
_QD_FREE = gl.constexpr(1)
_KV_READY = gl.constexpr(2)  # + D half
_KV_FREE = gl.constexpr(4)  # + D half
_PDS_READY = gl.constexpr(6)
_PDS_FREE = gl.constexpr(7)
_KVR_FREE = gl.constexpr(8)  # the kv block's score-only columns (ROPE), read by both consumers
_PDS2_READY = gl.constexpr(9)  # + P/dS buffer: SPLIT == 2 double-buffers P and dS
_PDS2_FREE = gl.constexpr(11)  # + P/dS buffer
_N_BARS = gl.constexpr(13)
_QD_FREE_EARLY = gl.constexpr(13)  # q's and dO's first QD_EARLY quarters (QD_EARLY: one more barrier)
# Events of a tile's timeline (``launch(trace=...)``, measurement only): the producer's tile
# start, q/dO issued (its wait for them free passed), the first and the last block's gather
# issued; a consumer's (+ 4 * WG) tile start, q/dO landed, block loop left, tile's end.
_EV_P_TILE = gl.constexpr(0)
_EV_P_QD = gl.constexpr(1)
_EV_P_FIRST = gl.constexpr(2)
_EV_P_LAST = gl.constexpr(3)
_EV_C_TILE = gl.constexpr(4)
_EV_C_QD = gl.constexpr(5)
_EV_C_LOOP = gl.constexpr(6)
_EV_C_END = gl.constexpr(7)
_N_EV = gl.constexpr(12)
TRACE_EVENTS = ("p_tile", "p_qd", "p_first", "p_last", "c0_tile", "c0_qd", "c0_loop", "c0_end",
                "c1_tile", "c1_qd", "c1_loop", "c1_end")
# How many slot blocks a pair's leader may run ahead of its follower's adds (see
# _consume_tile). H200, T=4096, H=128: 0 (lockstep) -8.8% backward time against no pacing
# at K=1152 and K=512, 1 -7.5%, 2 -4%, 4 -1%
# (docs/performance/backward.md#pacing-the-head-block-pair). Must be >= 0.
_LAG = gl.constexpr(0)
_BH = gl.constexpr(BLOCK_H)
_BK = gl.constexpr(BLOCK_K)
_QD = gl.constexpr(128)  # D quarter: D = 512 only
# The consumers' wgmma accumulator layouts: S, dP and the dKV pieces ([64, 64]), dQ
# ([64, 128]: a D quarter).
_S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                              instr_shape=[16, BLOCK_K, 16]))
_DQ_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                               instr_shape=[16, 128, 16]))


@gluon.jit
def _chunk_tile(ORDER, t_begin, pos, HAS_LEN: gl.constexpr):
    """(position within the chunk, token) of a persistent program's tile position ``pos``:
    (pos, t_begin + pos), or with lengths in their balanced order (HAS_LEN 1) the pair
    ``ORDER[pos]`` (``schedule``); with lengths in token order (HAS_LEN 2: ``launch(in_order=
    True)``) as without. The position indexes the chunk's partial rows."""
    if HAS_LEN == 1:
        c = gl.load(ORDER + 2 * pos).to(gl.int64)
        t = gl.load(ORDER + 2 * pos + 1).to(gl.int64)
    else:
        c = pos.to(gl.int64)
        t = t_begin + c
    return c, t


@gluon.jit
def _producer(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN: gl.constexpr,
              ABL: gl.constexpr):
    _produce(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN, ABL, 0, False, 0)


@gluon.jit
def _producer_sorted(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN: gl.constexpr,
                     ABL: gl.constexpr):
    _produce(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN, ABL, 0, False, 0, 1)


@gluon.jit
def _chain_ready(SYNC, c, need_t, need_f2):
    """Chained launches (``backward.FOLD_CHAIN``): 1 once every tile of chunk
    c - 1 has stored its rows and chunk c - 2's fold has ended (so the sums it continues are
    final), else 0. ``SYNC``: int32 counters, chunk k's tiles done at 2 k and its fold done at
    2 k + 1 (k counted from 3: the chunks before the first read zeros against targets 0);
    read with acquire, as the other waits on counters are, so the rows and sums they count
    are seen."""
    t = gl.atomic_add(SYNC + 2 * (c - 1), 0, sem="acquire", scope="gpu")
    f = gl.atomic_add(SYNC + 2 * (c - 2) + 1, 0, sem="acquire", scope="gpu")
    return ((t >= need_t) & (f >= need_f2)).to(gl.int32)


@gluon.jit
def _producer_rope(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN: gl.constexpr,
                   ABL: gl.constexpr):
    _produce(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN, ABL, 64, False, 0)


@gluon.jit
def _producer_qd_tma(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN: gl.constexpr,
                     ABL: gl.constexpr):
    _produce(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN, ABL, 0, True, 0)


@gluon.jit
def _producer_qd_early2(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN: gl.constexpr,
                        ABL: gl.constexpr):
    _produce(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN, ABL, 0, True, 2)


@gluon.jit
def _producer_qd_early3(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN: gl.constexpr,
                        ABL: gl.constexpr):
    _produce(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN, ABL, 0, True, 3)


@gluon.jit
def _produce(io, sizes, strides, smem, t_begin, n_tiles, nb, rank, HAS_LEN: gl.constexpr, ABL: gl.constexpr,
             ROPE: gl.constexpr, QD_TMA: gl.constexpr, EARLY: gl.constexpr, SORTED: gl.constexpr = 0):
    # (ROPE, QD_TMA and EARLY arrive as literals from the _producer* wrappers: a constexpr passed
    # through warp_specialize's argument tuple reaches the partition as a plain value, and
    # the rope code below then fails to lower when ROPE is 0). QD_TMA: Q and DO are
    # [T, H, D] tensor descriptors with [1, 64, 128] blocks, not pointers.
    Q, DO, KV, IDX, LEN, ORDER, TR, UNITS, FOLDIO = io
    H, N, K = sizes
    stride_qt, stride_qh, stride_dt, stride_dh, stride_kvn, stride_it = strides
    q_smem, do_smem, kv_smem, qr_smem, kvr_smem, bars, rank_smem, f_buf, f_words = smem
    # SORTED: each block's slots' partial-row ranks (RANK, ``backward.FOLD_IN_MAIN``) into
    # rank_smem for the consumers' stores; FOLD (where the kernel allocated the fold's ring:
    # f_buf, and f_words int64 [S, NP, E]): the previous chunk's fold between the gathers.
    # CHAIN (chained launches, ``backward.FOLD_CHAIN``; SYNC int32): the fold starts once the previous
    # chunk is ready (``_chain_ready``, polled after each block's gathers, waited for after
    # the last), and its end is counted in SYNC.
    RANK, FSID, FSEG, FP, FE, ACC, CHAINIO, fold_count, fold_ahead = FOLDIO
    SYNC, chain_c, need_t, need_f2 = CHAINIO
    FOLD: gl.constexpr = f_words.dtype == gl.int64
    CHAIN: gl.constexpr = SYNC.dtype.element_ty == gl.int32
    offs_rk = gl.arange(0, _BK, layout=gl.BlockedLayout([1], [32], [4], [0]))
    if FOLD:
        F_S: gl.constexpr = f_buf.shape[0]
        F_NP: gl.constexpr = f_words.shape[1]
        F_E: gl.constexpr = f_words.shape[2]
        fw = fold_view(f_words, gl.int64, F_S, F_E * F_NP, fold_flat1)
        # (chained: the share now, its start once chunk c - 1 is ready)
        fstate = fold_begin(FSID, FSEG, ACC, N, rank, gl.num_programs(0), fold_ahead, f_buf, fw, FP, FE, F_E,
                            F_S, F_NP, not CHAIN)
        fstarted = need_t * 0
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # 16-byte copies
    offs_d = gl.arange(0, _QD, layout=gl.SliceLayout(0, ld))
    offs_r = gl.arange(0, _BK, layout=gl.SliceLayout(1, ld))
    # the score-only columns (ROPE > 0: the 576/512 layout), 64 wide
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs_rd = 4 * _QD + gl.arange(0, 64, layout=gl.SliceLayout(0, ld_r))
    offs_rr = gl.arange(0, _BK, layout=gl.SliceLayout(1, ld_r))
    n_units, n_full, n_parts = UNITS
    n_hb = gl.cdiv(H, _BH)
    tcount = 0
    bcount = 0  # slot blocks gathered so far (the barriers' phases)
    for unit in range(rank, n_units, gl.num_programs(0)):
        tile, b0, nb_u, prow = _unit(unit, n_full, n_parts, nb)
        pos_c, pid_t = _chunk_tile(ORDER, t_begin, tile // n_hb, HAS_LEN)
        pid_h = tile % n_hb
        k_end, nb_t, g0 = _tile_blocks(LEN, pid_t, K, b0, nb_u, bcount, HAS_LEN)
        if ABL & 16:
            _stamp(TR, n_tiles, rank, tcount, _EV_P_TILE, ABL)
        # q and dO of this tile, once both consumers are done with the previous tile's
        # (a fresh mbarrier counts its phase "1" as complete: the first wait passes).
        if EARLY == 0:
            mbarrier.wait(bars.index(_QD_FREE), (tcount & 1) ^ 1)
        if ABL & 16:
            _stamp(TR, n_tiles, rank, tcount, _EV_P_QD, ABL)
        if QD_TMA:  # eight TMA tiles, counted in bytes on the barrier (heads past H: zeros)
            t32 = pid_t.to(gl.int32)  # (TMA coordinates are 32-bit)
            h32 = (pid_h * _BH).to(gl.int32)
            if EARLY > 0:  # the first EARLY quarters as soon as the last block's pieces are done with them
                mbarrier.wait(bars.index(_QD_FREE_EARLY), (tcount & 1) ^ 1)
            mbarrier.expect(bars.index(_QD_READY), 8 * _BH * _QD * q_smem.dtype.primitive_bitwidth // 8)
            for c in gl.static_range(4):
                if EARLY > 0 and c == EARLY:  # the others once both consumers are done with the tile
                    mbarrier.wait(bars.index(_QD_FREE), (tcount & 1) ^ 1)
                q_box = q_smem.index(c).reshape([1, _BH, _QD])
                do_box = do_smem.index(c).reshape([1, _BH, _QD])
                tma_load(Q, [t32, h32, c * _QD], bars.index(_QD_READY), q_box)
                tma_load(DO, [t32, h32, c * _QD], bars.index(_QD_READY), do_box)
        else:
            h = pid_h * _BH + offs_r  # _BH == _BK: the row offsets serve both
            h_ok = (h < H)[:, None]
            h64 = h[:, None].to(gl.int64)
            q_ptrs = Q + pid_t * stride_qt + h64 * stride_qh + offs_d[None, :]
            do_ptrs = DO + pid_t * stride_dt + h64 * stride_dh + offs_d[None, :]
            if (ABL & 2) == 0 or tcount == 0:  # (ablation 2: the first tile's q and dO only)
                for c in gl.static_range(4):
                    async_load(q_smem.index(c), q_ptrs + c * _QD, mask=h_ok)
                    async_load(do_smem.index(c), do_ptrs + c * _QD, mask=h_ok)
            if ROPE > 0:
                hr = pid_h * _BH + offs_rr
                async_load(qr_smem.index(0), Q + pid_t * stride_qt + hr[:, None].to(gl.int64) * stride_qh
                           + offs_rd[None, :], mask=(hr < H)[:, None])
            cp.mbarrier_arrive(bars.index(_QD_READY), increment_count=False)

        idx_row = IDX + pid_t * stride_it + b0 * _BK
        ids = load_ids(idx_row, 0, k_end, offs_r)
        for j in range(0, nb_t):
            free_phase = ((g0 + j) & 1) ^ 1
            ids64 = ids.to(gl.int64)
            valid = (ids64 >= 0) & (ids64 < N)
            rows = gl.where(valid, ids64, 0)  # masked ids never form an address (zero rows)
            ptrs = KV + rows[:, None] * stride_kvn + offs_d[None, :]
            vm = valid[:, None]
            if ROPE > 0:  # (the ids again, in the rope columns' load layout)
                ids_r = load_ids(idx_row, j * _BK, k_end, offs_rr).to(gl.int64)
                valid_r = (ids_r >= 0) & (ids_r < N)
                ptrs_r = KV + gl.where(valid_r, ids_r, 0)[:, None] * stride_kvn + offs_rd[None, :]
            ids = load_ids(idx_row, (j + 1) * _BK, k_end, offs_r)  # next block's ids, ahead
            for half in gl.static_range(2):
                mbarrier.wait(bars.index(_KV_FREE + half), free_phase)
                async_load(kv_smem.index(2 * half), ptrs + (2 * half) * _QD, mask=vm)
                async_load(kv_smem.index(2 * half + 1), ptrs + (2 * half + 1) * _QD, mask=vm)
                if ROPE > 0 and half == 1:  # with the second half: S needs it, both dQs read it
                    mbarrier.wait(bars.index(_KVR_FREE), free_phase)
                    async_load(kvr_smem.index(0), ptrs_r, mask=valid_r[:, None])
                if SORTED and half == 1:  # the block's ranks (0 past K: the parts' row 0)
                    slot_k = (b0 + j) * _BK + offs_rk
                    async_load(rank_smem.index((g0 + j) & 1), RANK + pos_c * K + slot_k, mask=slot_k < K)
                cp.mbarrier_arrive(bars.index(_KV_READY + half), increment_count=False)
            if FOLD:  # fold tiles once the block's gathers and their arrives are issued
                n_fold = fold_count
                if CHAIN:  # (polled a block: the fold starts once chunk c - 1 is ready, no tile before)
                    if fstarted == 0:
                        if _chain_ready(SYNC, chain_c, need_t, need_f2) != 0:
                            fstate = fold_start(fstate, ACC, fold_ahead, f_buf, fw, FP, FE, F_E, F_S, F_NP)
                            fstarted = fstarted * 0 + 1
                    n_fold = fold_count * fstarted
                fstate = fold_tiles(fstate, n_fold, fold_ahead, FSID, FSEG, ACC, f_buf, fw, FP, FE, F_E,
                                    F_S, F_NP)
            if ABL & 16:
                if j == 0:
                    _stamp(TR, n_tiles, rank, tcount, _EV_P_FIRST, ABL)
        if ABL & 16:
            _stamp(TR, n_tiles, rank, tcount, _EV_P_LAST, ABL)
        tcount += 1
        bcount += nb_t
    if FOLD:  # what is left of the fold
        if CHAIN:
            if fstarted == 0:
                while _chain_ready(SYNC, chain_c, need_t, need_f2) == 0:
                    pass
                fstate = fold_start(fstate, ACC, fold_ahead, f_buf, fw, FP, FE, F_E, F_S, F_NP)
        fstate = fold_tiles(fstate, 1 << 30, fold_ahead, FSID, FSEG, ACC, f_buf, fw, FP, FE, F_E, F_S, F_NP)
        if CHAIN:  # this program's share of chunk c - 1's fold has ended (its sums stored)
            thread_barrier()
            gl.atomic_add(SYNC + 2 * (chain_c - 1) + 1, 1, sem="release", scope="gpu")


@gluon.jit
def _unit(unit, n_full, n_parts, nb):
    """A program's unit of work: tile ``unit`` whole below ``n_full``; past it, part
    ``(unit - n_full) % n_parts`` of remainder tile ``n_full + (unit - n_full) // n_parts``
    (the tiles past the last whole round, cut by slot blocks so that the round's programs
    share them). Returns (tile, its first slot block, its slot blocks, the part's row in the
    dQ parts or -1)."""
    v = gl.maximum(unit - n_full, 0)
    part = v % n_parts
    bp = gl.cdiv(nb, n_parts)
    is_part = unit >= n_full
    tile = gl.where(is_part, n_full + v // n_parts, unit)
    b0 = gl.where(is_part, part * bp, 0)
    nb_u = gl.where(is_part, gl.minimum(nb - part * bp, bp), nb)
    prow = gl.where(is_part, v, -1)
    return tile, b0, nb_u, prow


@gluon.jit
def _tile_blocks(LEN, pid_t, K, b0, nb_u, bcount, HAS_LEN: gl.constexpr):
    """A unit's slot bound, its 64-slot blocks and the blocks before it (the barriers'
    phases, the running count ``bcount``: units differ). Without lengths the unit's blocks
    [b0, b0 + nb_u) (a whole tile: 0 and all of them; ``_unit``), the bound counted from
    its first slot; with them (no parts), the token's length clamped to [0, K]."""
    if HAS_LEN:
        # (.to: without lengths LEN is a dummy pointer, the ids, which may be int64; the
        # branch is still type-checked)
        k_end = gl.minimum(gl.maximum(gl.load(LEN + pid_t).to(gl.int32), 0), K)
        nb_t = gl.cdiv(k_end, _BK)
    else:
        k_end = K - b0 * _BK
        nb_t = nb_u
    return k_end, nb_t, bcount


@gluon.jit
def _consumer(args, WG: gl.constexpr, RED: gl.constexpr, HAS_LEN: gl.constexpr, ROPE: gl.constexpr,
              EVICT_LAST: gl.constexpr, SPLIT: gl.constexpr, EARLY: gl.constexpr, DQ_TMA: gl.constexpr,
              ABL: gl.constexpr, HP: gl.constexpr, TRANS: gl.constexpr, PARTS: gl.constexpr,
              PAIRS: gl.constexpr = True, SORTED: gl.constexpr = 0):
    io, sizes, strides, smem, scales, t_begin, n_tiles, nb, rank, paired, units, chain = args
    H, N, K = sizes
    IDX, LSE, DELTA, DQ, ACC, PARTIAL, FLAGS, LEN, ORDER, DQR, TR, DQP, EXP = io
    n_units = units[0]  # (and with PARTS: n_full, n_parts and DQF)
    n_hb = gl.cdiv(H, _BH)
    tcount = 0
    bcount = 0  # slot blocks consumed so far (the barriers' phases)
    SYNC, chain_c, need_f3 = chain
    CHAIN: gl.constexpr = SYNC.dtype.element_ty == gl.int32  # (chained launches: backward.FOLD_CHAIN)
    if CHAIN:  # this chunk's buffer held chunk c - 3's rows: their fold has ended
        while gl.atomic_add(SYNC + 2 * (chain_c - 3) + 1, 0, sem="acquire", scope="gpu") < need_f3:
            pass
    for unit in range(rank, n_units, gl.num_programs(0)):
        if PARTS:  # (PARTS: the launch cut the remainder's tiles; fast mode, no lengths)
            tile, b0, nb_u, prow = _unit(unit, units[1], units[2], nb)
            part = (units[3], prow)
        else:
            tile = unit
            b0 = 0
            nb_u = nb
            part = (ACC, -1)
        pid_c, pid_t = _chunk_tile(ORDER, t_begin, tile // n_hb, HAS_LEN)
        pid_h = tile % n_hb
        k_end, nb_t, g0 = _tile_blocks(LEN, pid_t, K, b0, nb_u, bcount, HAS_LEN)
        # (a part's ids row from its first block)
        io_u = (IDX + b0 * _BK, LSE, DELTA, DQ, ACC, PARTIAL, FLAGS, LEN, ORDER, DQR, TR, DQP, EXP, part)
        if ABL & 16:
            _stamp(TR, n_tiles, rank, tcount, _EV_C_TILE + 4 * WG, ABL)
        if TRANS:
            _consume_tile_split_t(io_u, sizes, strides, smem, scales, nb, nb_t, g0, k_end, pid_c,
                                  pid_t, tcount, n_tiles, rank, WG, RED, EVICT_LAST, SPLIT, DQ_TMA,
                                  HP)
        elif SPLIT:
            _consume_tile_split(io_u, sizes, strides, smem, scales, nb, nb_t, g0, k_end, pid_c, pid_t,
                                pid_h, n_hb, tcount, paired, n_tiles, rank, WG, RED, EVICT_LAST, SPLIT,
                                EARLY, DQ_TMA, ABL, HP, PARTS, PAIRS)
        else:
            _consume_tile(io_u, sizes, strides, smem, scales, nb, nb_t, g0, k_end, pid_c, pid_t,
                          pid_h, n_hb, tcount, paired, n_tiles, rank, WG, RED, HAS_LEN, ROPE, EVICT_LAST,
                          DQ_TMA, ABL, HP, PARTS, PAIRS, SORTED)
        if ABL & 16:
            _stamp(TR, n_tiles, rank, tcount, _EV_C_END + 4 * WG, ABL)
        tcount += 1
        bcount += nb_t
    if CHAIN:  # this program's rows of the chunk stored (both consumers count: 2 a program)
        thread_barrier()
        gl.atomic_add(SYNC + 2 * chain_c, 1, sem="release", scope="gpu")


@gluon.jit
def _head_rows(LSE, DELTA, H, pid_t, pid_h, stride_lt, row_l: gl.constexpr, NH: gl.constexpr = _BH):
    """The tile's first NH (64) heads: ``row_ok``, lse in the log2 domain and Delta. Rows with lse =
    -inf (no valid slot, no sink) and padding heads have P = 0; a NaN lse (a NaN sink)
    gives NaN P, as in the reference (docs/design.md#non-finite-values)."""
    h_row = pid_h * _BH + gl.arange(0, NH, layout=row_l)
    h_ok = h_row < H
    lse = gl.load(LSE + pid_t * stride_lt + h_row, mask=h_ok, other=float("-inf"))
    row_ok = h_ok & (lse != float("-inf"))
    lse2 = gl.where(row_ok, lse * 1.4426950408889634, 0.0)
    delta = gl.load(DELTA + pid_t * H + h_row, mask=h_ok, other=0.0)
    return row_ok, lse2, delta


@gluon.jit
def _tile_start(LSE, DELTA, IDX, H, pid_t, pid_h, stride_lt, stride_it, ABL: gl.constexpr = 0):
    """What both consumer schedules set up at a tile's start: its heads (``_head_rows``),
    the slot and column offsets in S's wgmma layout (a dKV piece, [_BK slots, 64 columns],
    has that layout too: each thread holds two slot rows and pairs of adjacent columns),
    the token's ids and the zero accumulators of S, dQ and a dKV piece."""
    s_l: gl.constexpr = _S_L
    row_l: gl.constexpr = gl.SliceLayout(1, s_l)
    col_l: gl.constexpr = gl.SliceLayout(0, s_l)
    if ABL & 4:  # (ablation 4: no lse / Delta loads: lse and Delta 0)
        h_row = pid_h * _BH + gl.arange(0, _BH, layout=row_l)
        row_ok = h_row < H
        lse2 = gl.zeros([_BH], gl.float32, layout=row_l)
        delta = lse2
    else:
        row_ok, lse2, delta = _head_rows(LSE, DELTA, H, pid_t, pid_h, stride_lt, row_l)
    offs_c = gl.arange(0, _BK, layout=col_l)
    offs_dd = gl.arange(0, 64, layout=col_l)
    offs_ks = gl.arange(0, _BK, layout=row_l)
    idx_row = IDX + pid_t * stride_it
    s_zero = gl.zeros([_BH, _BK], gl.float32, layout=s_l)
    dq_zero = gl.zeros([_BH, _QD], gl.float32, layout=_DQ_L)
    dkv_zero = gl.zeros([_BK, 64], gl.float32, layout=s_l)
    return row_ok, lse2, delta, offs_c, offs_dd, offs_ks, idx_row, s_zero, dq_zero, dkv_zero


@gluon.jit
def _pair_roles(FLAGS, paired, pid_c, pid_h, n_hb, nb, offs_ks, RED: gl.constexpr,
                PAIRS: gl.constexpr = True):
    """A tile's part in a head-block pair (deterministic path; see ``_consume_tile``):
    ``follower``, ``leader``, the partial rows of my slots in the tile's first block
    (``slot0``) and the pair's flag words (``flag_base``: + consumer or block parity).
    Without ``PAIRS`` the pairs' code is compiled out."""
    if PAIRS:
        pairs = paired != 0
    else:
        pairs = (paired != 0) & False
    follower = pairs & (pid_h % 2 == 1)
    leader = pairs & (pid_h % 2 == 0)
    n_part = n_hb // (1 + paired)
    part_h = pid_h // (1 + paired)
    # (int32: the chunk's partial-row blocks number far fewer than 2^31; an int64 block base
    # took two registers, which Triton 3.9's ptxas spilled)
    part_t = pid_c.to(gl.int32) * n_part + part_h
    blk0 = part_t * nb  # the first partial-row block of this tile's rows
    # (int32; one invariant a thread, with _row_pair, not the block and the slot apart)
    slot0 = blk0 * _BK + offs_ks
    flag_base = FLAGS + 1 + part_t * 2
    return follower, leader, slot0, flag_base


@gluon.jit
def _qk(a_smem, kv_smem, quarter, acc, use_acc: gl.constexpr = True):
    """acc + a[quarter] kv[quarter]^T, issued asynchronously; the quarter's index formed here
    (``hopper.fresh``: under Triton 3.9 the descriptors stay in the uniform datapath)."""
    return warpgroup_mma(a_smem.index(fresh(quarter)), kv_smem.index(fresh(quarter)).permute((1, 0)), acc,
                         use_acc=use_acc, is_async=True)


@gluon.jit
def _scores(q_smem, do_smem, kv_smem, qr_smem, kvr_smem, bars, z, ph, ids, N, s_zero, scale, scale_log2,
            lse2, row_ok, delta, ROPE: gl.constexpr):
    """A block's S = q kv^T and dP = dO kv^T (each kv half as soon as it has landed), then
    P and dS (scale folded in); masked slots (ids out of [0, N)) have P = 0."""
    mbarrier.wait(bars.index(_KV_READY + 0), ph)
    fence_async_shared()
    s = _qk(q_smem, kv_smem, z, s_zero, False)
    dp = _qk(do_smem, kv_smem, z, s_zero, False)
    s = _qk(q_smem, kv_smem, z + 1, s)
    dp = _qk(do_smem, kv_smem, z + 1, dp)
    mbarrier.wait(bars.index(_KV_READY + 1), ph)
    fence_async_shared()
    s = _qk(q_smem, kv_smem, z + 2, s)
    dp = _qk(do_smem, kv_smem, z + 2, dp)
    s = _qk(q_smem, kv_smem, z + 3, s)
    dp = _qk(do_smem, kv_smem, z + 3, dp)
    if ROPE > 0:  # the score-only columns: S only
        s = _qk(qr_smem, kvr_smem, z, s)
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
    valid = (ids >= 0) & (ids < N)
    p = gl.exp2(s * scale_log2 - lse2[:, None])
    p = gl.where(row_ok[:, None] & valid[None, :], p, 0.0)
    ds = p * (dp - delta[:, None]) * scale
    return p, ds


@gluon.jit
def _dkv_rows(ACC, PARTIAL, idx_row, j, z, k_end, N, offs_kz, slot0, RED: gl.constexpr, D: gl.constexpr,
              ABL: gl.constexpr = 0):
    """Where block j's dKV rows go, a thread's two rows (``_row_pair``): the fast mode's
    accumulator rows by id, with ``on`` 0 for a masked slot; else the tile's partial rows."""
    if RED:
        # (the bound was written k_end + z while j was LLVM's induction variable: Triton
        # 3.9 turned the mask into per-element 64-bit bounds, hoisted out of the loop and
        # spilled. With j opaque the plain bound is better there: 7 / 8 -> 6 / 7 reloads)
        ids_k = load_ids(idx_row, j * _BK, k_end, offs_kz).to(gl.int64)
        valid_k = (ids_k >= 0) & (ids_k < N)
        # A masked slot adds nothing (its reductions are predicated off): no row is
        # touched for it, so a NaN in an unselected row stays there. (Adding masked
        # slots' zeros to a spare row instead made every masked slot of the grid
        # contend for that one row: 46 ms instead of 8.7 at H128 K1152 with causal ids.)
        if RED == 7:  # exact two-word sums: rows of 2 D, and each row's grid code (PARTIAL)
            row_ptr = ACC + gl.where(valid_k, ids_k, 0) * (2 * D)
            on = gl.load(PARTIAL + ids_k, mask=valid_k, other=0)
        else:
            row_ptr = ACC + gl.where(valid_k, ids_k, 0) * D
            on = valid_k.to(gl.int32)
        if ABL & 8:  # (ablation 8: every reduction predicated off, at run time: still issued)
            on = on * (N < 0).to(gl.int32)
    else:
        on = offs_kz  # (unused on this path)
        # (the buffer's slot dim is padded to whole blocks: stores need no mask)
        # (j ^ z == j, but not an induction variable: LLVM would otherwise strength-reduce
        # every store address into its own loop-carried pointer)
        row_ptr = PARTIAL + _row_pair(slot0 + (j ^ z) * _BK).to(gl.int64) * D
    return row_ptr, on


@gluon.jit
def _store_dq(DQ, dq0, dq1, H, pid_t, pid_h, stride_gt, stride_gh, WG: gl.constexpr):
    """Consumer WG's half of the tile's dQ value columns (two D quarters), in DQ's dtype."""
    h_q = pid_h * _BH + gl.arange(0, _BH, layout=gl.SliceLayout(1, _DQ_L))
    d_q = WG * 2 * _QD + gl.arange(0, _QD, layout=gl.SliceLayout(0, _DQ_L))
    dq_ptrs = DQ + pid_t * stride_gt + h_q[:, None].to(gl.int64) * stride_gh + d_q[None, :]
    hq_ok = (h_q < H)[:, None]
    gl.store(dq_ptrs, dq0.to(DQ.dtype.element_ty), mask=hq_ok)
    gl.store(dq_ptrs + _QD, dq1.to(DQ.dtype.element_ty), mask=hq_ok)


@gluon.jit
def _store_dq_tma(DQ, dq0, dq1, buf, pid_t, pid_h, WG: gl.constexpr):
    """Consumer WG's half of the tile's dQ value columns through quarters 2 WG and 2 WG + 1
    of ``buf`` (q's [4, 64, 128] buffer, those quarters free of readers) and two TMA stores
    into DQ, a [T, H, D] descriptor of [1, 64, 128] boxes (heads past H are not written);
    returns once the TMA has read them."""
    buf.index(2 * WG).store(dq0.to(buf.dtype))
    buf.index(2 * WG + 1).store(dq1.to(buf.dtype))
    _send_dq_tma(DQ, buf, pid_t, pid_h, WG)


@gluon.jit
def _send_dq_tma(DQ, buf, pid_t, pid_h, WG: gl.constexpr):
    """Quarters 2 WG and 2 WG + 1 of ``buf``, just written by this warp group, into DQ by two
    TMA stores of [1, 64, 128] boxes (heads past H are not written); returns once the TMA
    has read them."""
    fence_async_shared()
    thread_barrier()
    t32 = pid_t.to(gl.int32)  # (TMA coordinates are 32-bit)
    h32 = (pid_h * _BH).to(gl.int32)
    for c in gl.static_range(2):
        tma_store(DQ, [t32, h32, (2 * WG + c) * _QD], buf.index(2 * WG + c).reshape([1, _BH, _QD]))
    tma_store_wait(0)
    thread_barrier()  # (the thread that issued the stores has seen them read)


@gluon.jit
def _wait_last_block_read(bars, g0, nb_t, SPLIT: gl.constexpr):
    """In a split schedule, until the owner of the tile's last block has read q and dO for the
    last time: its arrival on that block's P/dS free barrier comes after its last wgmma (the
    owner itself passes at once). No wait in a tile without blocks."""
    if nb_t > 0:
        pb, pph, ready, free = _pds_slot(bars, g0 + nb_t - 1, 0, SPLIT)
        mbarrier.wait(free, pph)


@gluon.jit
def _tile_dq_out(DQ, dq0, dq1, H, pid_t, pid_h, stride_gt, stride_gh, q_smem, bars, g0, nb_t,
                 WG: gl.constexpr, SPLIT: gl.constexpr, DQ_TMA: gl.constexpr, ABL: gl.constexpr,
                 TR, n_tiles, rank, tcount, PART, PARTS: gl.constexpr = False):
    """The end of consumer WG's tile in either schedule (``SPLIT`` 0: unsplit): its dQ half
    out (``DQ_TMA``: 0 plain stores, 1 through its q quarters by TMA)
    and q and dO released to the producer (``_QD_FREE``). With ``PARTS``, ``PART`` = (DQF,
    prow): a part of a remainder tile (prow >= 0) stores its dQ part in fp32 into DQF's row
    block prow ([parts, 64, 512]), for the backward's epilogue (or ``backward.sum_dq_parts``)
    to sum. (Without PARTS there is no such branch: folded away, it failed to lower under
    Triton 3.6.)"""
    if PARTS:
        DQF, prow = PART
        if prow >= 0:
            mbarrier.arrive(bars.index(_QD_FREE))
            _store_dq(DQF, dq0, dq1, _BH, prow, 0, _BH * 4 * _QD, 4 * _QD, WG)
        else:
            _tile_dq_whole(DQ, dq0, dq1, H, pid_t, pid_h, stride_gt, stride_gh, q_smem, bars, g0, nb_t,
                           WG, SPLIT, DQ_TMA, ABL, TR, n_tiles, rank, tcount)
    else:
        _tile_dq_whole(DQ, dq0, dq1, H, pid_t, pid_h, stride_gt, stride_gh, q_smem, bars, g0, nb_t,
                       WG, SPLIT, DQ_TMA, ABL, TR, n_tiles, rank, tcount)


@gluon.jit
def _tile_dq_whole(DQ, dq0, dq1, H, pid_t, pid_h, stride_gt, stride_gh, q_smem, bars, g0, nb_t,
                   WG: gl.constexpr, SPLIT: gl.constexpr, DQ_TMA: gl.constexpr, ABL: gl.constexpr,
                   TR, n_tiles, rank, tcount):
    """A whole tile's dQ half out and q and dO released (``_tile_dq_out``)."""
    if DQ_TMA == 1:
        # My q quarters: in the split schedules the last block's owner reads every quarter in
        # its dKV pieces, so wait until it has; unsplit, only my own pieces read them, and the
        # S of every block came before.
        if SPLIT > 0:
            _wait_last_block_read(bars, g0, nb_t, SPLIT)
        if ABL & 16:  # (the timeline: the last block's dKV pieces done, dQ not yet out)
            _stamp(TR, n_tiles, rank, tcount, _EV_C_LOOP + 4 * WG, ABL)
        if (ABL & 1) == 0:  # (ablation 1: no dQ stores)
            _store_dq_tma(DQ, dq0, dq1, q_smem, pid_t, pid_h, WG)
    elif ABL & 16:
        _stamp(TR, n_tiles, rank, tcount, _EV_C_LOOP + 4 * WG, ABL)
    mbarrier.arrive(bars.index(_QD_FREE))  # q and dO may be replaced by the next tile's
    if not DQ_TMA and (ABL & 1) == 0:  # (ablation 1: no dQ stores)
        _store_dq(DQ, dq0, dq1, H, pid_t, pid_h, stride_gt, stride_gh, WG)


@gluon.jit
def _consume_tile_split(io, sizes, strides, smem, scales, nb, nb_t, g0, k_end, pid_c, pid_t, pid_h, n_hb,
                        tcount, paired, n_tiles, rank, WG: gl.constexpr, RED: gl.constexpr,
                        EVICT_LAST: gl.constexpr, SPLIT: gl.constexpr, EARLY: gl.constexpr,
                        DQ_TMA: gl.constexpr, ABL: gl.constexpr, HP: gl.constexpr,
                        PARTS: gl.constexpr = False, PAIRS: gl.constexpr = True):
    """One (token, 64-head block) tile of consumer ``WG``, the block's roles split in time:
    the owner of block g (g % 2 == WG) computes S, dP, P and dS, both consumers add dS KV
    to their halves of dQ, and then the owner forms all of the block's dKV rows (8 pieces
    of 64 columns) and sends them (reductions, or partial rows: ``RED``), while the other
    consumer, the owner of block g + 1, computes that block's S and dP. So the tensor cores
    have a second issuer through each softmax, and a block's dKV traffic comes from one
    consumer spread over the other's S and dP, not from both at once after the same
    hand-off (the schedule of ``_consume_tile``). ``SPLIT`` 1: P and dS single-buffered,
    the owner of g + 1 stores its P and dS once the owner of g has read them for the last
    time; 2: double-buffered (block g in buffer g % 2, which is its owner's), so it need
    not wait.

    Head-block pairs (partial rows): as in ``_consume_tile``, but the counts are per block
    parity, not per consumer: the blocks j of one parity are those one consumer of each
    program owns, in order (a tile's first block's owner differs between the two programs
    of a pair).

    ``EARLY`` > 0: the owner of the tile's last block releases the first EARLY D quarters of
    q and dO (``_QD_FREE_EARLY``) once its dKV pieces are done with them; the other consumer
    (and both, in a tile without blocks) releases them at the tile's end, where both
    release the rest (``_QD_FREE``) as without."""
    IDX, LSE, DELTA, DQ, ACC, PARTIAL, FLAGS, LEN, ORDER, DQR, TR, DQP, EXP, PART = io
    H, N, K = sizes
    stride_it, stride_lt, stride_gt, stride_gh = strides
    q_smem, do_smem, kv_smem, qr_smem, kvr_smem, p_smem, ds_smem, bars, rank_smem = smem
    scale, scale_log2 = scales
    D: gl.constexpr = 4 * _QD
    dtype: gl.constexpr = q_smem.dtype

    row_ok, lse2, delta, offs_c, offs_dd, offs_ks, idx_row, s_zero, dq_zero, dkv_zero = _tile_start(
        LSE, DELTA, IDX, H, pid_t, pid_h, stride_lt, stride_it, ABL)
    dq0 = dq_zero
    dq1 = dq_zero
    # head-block pairs (deterministic path): see _consume_tile
    follower, leader, slot0, flag_base = _pair_roles(FLAGS, paired, pid_c, pid_h, n_hb, nb, offs_ks, RED,
                                                     PAIRS)
    # + block parity: the leader's published blocks, the follower's added blocks
    done_base = flag_base + n_tiles
    pace = leader & (gl.atomic_add(FLAGS, 0, sem="relaxed", scope="gpu") > rank + 1)

    mbarrier.wait(bars.index(_QD_READY), tcount & 1)
    if ABL & 16:
        _stamp(TR, n_tiles, rank, tcount, _EV_C_QD + 4 * WG, ABL)
    for jj in range(0, nb_t):
        j = _opaque(jj)  # (as in _consume_tile: the loop carries only its counter)
        g = g0 + j
        ph = g & 1
        z = j >> 31  # 0, unknown to the compiler (see _consume_tile)
        mine = g % 2 == WG
        if mine:  # my block: S, dP, P and dS
            pb, pph, ready, free = _pds_slot(bars, g, z, SPLIT, WG)
            ids = load_ids(idx_row, j * _BK, k_end, offs_c)
            p, ds = _scores(q_smem, do_smem, kv_smem, qr_smem, kvr_smem, bars, z, ph, ids, N, s_zero, scale,
                            scale_log2, lse2, row_ok, delta, 0)
            # The previous block's owner (the other consumer) forms its dKV rows from P and
            # dS while this S and dP run: store once it has read them for the last time.
            mbarrier.wait(free, pph ^ 1)
            p_smem.index(pb).store(p.to(dtype))
            ds_smem.index(pb).store(ds.to(dtype))
            fence_async_shared()
            mbarrier.arrive(ready)
        else:
            pb, pph, ready, free = _pds_slot(bars, g, z, SPLIT, 1 - WG)

        mbarrier.wait(ready, pph)
        # dQ[:, my half] += dS KV[:, my half] (scale is folded into dS).
        dq0 = warpgroup_mma(ds_smem.index(pb), kv_smem.index(2 * WG + fresh(z)), dq0, is_async=True)
        dq1 = warpgroup_mma(ds_smem.index(pb), kv_smem.index(2 * WG + 1 + fresh(z)), dq1, is_async=True)
        dq0, dq1 = warpgroup_mma_wait(num_outstanding=0, deps=(dq0, dq1))
        mbarrier.arrive(bars.index(_KV_FREE + WG))  # my kv half: the next block's gather may start
        if mine:
            # (again: the values after the branches above are runtime, in here constants)
            pb, pph, ready, free = _pds_slot(bars, g, z, SPLIT, WG)
            # All of the block's dKV rows: P^T dO + dS^T Q, 64 columns at a time, each piece
            # sent while the next one's wgmma runs.
            offs_kz = _row_pair(offs_ks + z)
            row_ptr, on = _dkv_rows(ACC, PARTIAL, idx_row, j, z, k_end, N, offs_kz, slot0, RED, D, ABL)
            acc = _dkv_piece(p_smem.index(pb), ds_smem.index(pb), do_smem, q_smem, z, 0, HP, dkv_zero)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            nxt = _dkv_piece(p_smem.index(pb), ds_smem.index(pb), do_smem, q_smem, z, 1, HP, dkv_zero)
            if follower:  # the leader's rows of this block must be in place before I add to them
                while gl.atomic_add(flag_base + j % 2, 0, sem="acquire", scope="gpu") <= j // 2:
                    pass
            if pace:  # no more than _LAG blocks ahead of the follower's adds
                back = j - 1 - _LAG
                if back >= 0:
                    while gl.atomic_add(done_base + back % 2, 0, sem="relaxed", scope="gpu") <= back // 2:
                        pass
            for i in gl.static_range(1, 8):
                if i > 1:
                    nxt = _dkv_piece(p_smem.index(pb), ds_smem.index(pb), do_smem, q_smem, i // 2 + z,
                                     i % 2, HP, dkv_zero)
                _send_piece(row_ptr + (((i - 1) // 2) * _QD + ((i - 1) % 2) * 64), offs_dd, acc, on, follower,
                            paired, RED, EVICT_LAST, (PARTIAL, EXP))
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, ))
                if EARLY > 0 and i == 2 * EARLY - 1:  # pieces 0..i read the quarters before EARLY
                    mbarrier.arrive(bars.index(_QD_FREE_EARLY), pred=jj == nb_t - 1)
            mbarrier.arrive(free)  # P and dS read for the last time
            _send_piece(row_ptr + (3 * _QD + 64), offs_dd, acc, on, follower, paired, RED, EVICT_LAST,
                        (PARTIAL, EXP))
            if leader:  # publish: every thread's stores of this block, then the count (release)
                thread_barrier()
                gl.atomic_add(flag_base + j % 2, 1, sem="release", scope="gpu")
            if follower:  # (pacing only: no ordering needed)
                gl.atomic_add(done_base + j % 2, 1, sem="relaxed", scope="gpu")
        else:
            mbarrier.arrive(free)  # (my dQ read dS for the last time)

    if EARLY > 0:  # (the last block's owner released the first quarters already)
        mbarrier.arrive(bars.index(_QD_FREE_EARLY), pred=(nb_t == 0) | ((g0 + nb_t - 1) % 2 != WG))
    _tile_dq_out(DQ, dq0, dq1, H, pid_t, pid_h, stride_gt, stride_gh, q_smem, bars, g0, nb_t, WG,
                 SPLIT, DQ_TMA, ABL, TR, n_tiles, rank, tcount, PART, PARTS)


@gluon.jit
def _pds_slot(bars, g, z, SPLIT: gl.constexpr, OWNER: gl.constexpr = -1):
    """Where block g's P and dS go in the split schedules: (buffer, its barriers' phase, the
    ready and free barriers). SPLIT 2: buffer g % 2 (``OWNER`` where the caller knows it: the
    consumer that owns block g; constant buffer and barrier addresses, which under Triton 3.9
    leave 4-5 reloads a block loop instead of 17-20), its phase per buffer; 1: one buffer.
    (``z``: 0, unknown to the compiler: see _consume_tile.)"""
    if SPLIT == 2:
        if OWNER < 0:
            pb = (g & 1) + z
            pph = (g >> 1) & 1
            ready = bars.index(_PDS2_READY + (g & 1))
            free = bars.index(_PDS2_FREE + (g & 1))
        else:
            pb = OWNER + z
            pph = (g >> 1) & 1
            ready = bars.index(_PDS2_READY + OWNER)
            free = bars.index(_PDS2_FREE + OWNER)
    else:
        pb = z
        pph = g & 1
        ready = bars.index(_PDS_READY)
        free = bars.index(_PDS_FREE)
    return pb, pph, ready, free


@gluon.jit
def _consume_tile_split_t(io, sizes, strides, smem, scales, nb, nb_t, g0, k_end, pid_c, pid_t, tcount,
                          n_tiles, rank, WG: gl.constexpr, RED: gl.constexpr, EVICT_LAST: gl.constexpr,
                          SPLIT: gl.constexpr, DQ_TMA: gl.constexpr, HP: gl.constexpr):
    """``_consume_tile_split`` for a tile of H <= HP (16 or 32) heads, its products transposed
    so that the heads are the wgmma's N (16 or 32), not a 64-row M of which H rows count:
    S^T = KV Q^T and dP^T = KV dO^T ([64 slots, HP]), P^T and dS^T kept as [64 slots, HP]
    in shared memory, dQ^T += KV^T dS^T ([64 columns, HP] pieces: four a consumer, its half
    of D) and the dKV rows P^T dO + dS^T Q (K = HP). The same barriers, roles and dKV
    pieces as ``_consume_tile_split``; one head block, so no head-block pairs."""
    IDX, LSE, DELTA, DQ, ACC, PARTIAL, FLAGS, LEN, ORDER, DQR, TR, DQP, EXP, PART = io
    H, N, K = sizes
    stride_it, stride_lt, stride_gt, stride_gh = strides
    q_smem, do_smem, kv_smem, qr_smem, kvr_smem, p_smem, ds_smem, bars, rank_smem = smem
    scale, scale_log2 = scales
    D: gl.constexpr = 4 * _QD
    dtype: gl.constexpr = q_smem.dtype
    t_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HP, 16])
    slot_l: gl.constexpr = gl.SliceLayout(1, t_l)
    head_l: gl.constexpr = gl.SliceLayout(0, t_l)
    row_ok, lse2, delta = _head_rows(LSE, DELTA, H, pid_t, 0, stride_lt, head_l, HP)
    offs_s = gl.arange(0, _BK, layout=slot_l)
    idx_row = IDX + pid_t * stride_it
    t_zero = gl.zeros([_BK, HP], gl.float32, layout=t_l)
    dkv_zero = gl.zeros([_BK, 64], gl.float32, layout=_S_L)
    offs_dd = gl.arange(0, 64, layout=gl.SliceLayout(0, _S_L))
    offs_ks = gl.arange(0, _BK, layout=gl.SliceLayout(1, _S_L))
    slot0 = (pid_c.to(gl.int32) * nb) * _BK + offs_ks  # (one head block: no pairs)
    dq0 = t_zero  # dQ^T, columns [256 WG + 64 i, +64) of D, i = 0..3
    dq1 = t_zero
    dq2 = t_zero
    dq3 = t_zero

    mbarrier.wait(bars.index(_QD_READY), tcount & 1)
    for jj in range(0, nb_t):
        j = _opaque(jj)
        g = g0 + j
        ph = g & 1
        z = j >> 31
        mine = g % 2 == WG
        pb, pph, ready, free = _pds_slot(bars, g, z, SPLIT)
        if mine:  # my block: S^T, dP^T, P^T and dS^T
            mbarrier.wait(bars.index(_KV_READY + 0), ph)
            fence_async_shared()
            s = _qk_t(kv_smem, q_smem, z, t_zero, HP, False)
            dp = _qk_t(kv_smem, do_smem, z, t_zero, HP, False)
            s = _qk_t(kv_smem, q_smem, z + 1, s, HP)
            dp = _qk_t(kv_smem, do_smem, z + 1, dp, HP)
            mbarrier.wait(bars.index(_KV_READY + 1), ph)
            fence_async_shared()
            for c in gl.static_range(2, 4):
                s = _qk_t(kv_smem, q_smem, z + c, s, HP)
                dp = _qk_t(kv_smem, do_smem, z + c, dp, HP)
            s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
            ids = load_ids(idx_row, j * _BK, k_end, offs_s)
            valid = (ids >= 0) & (ids < N)
            p = gl.exp2(s * scale_log2 - lse2[None, :])
            p = gl.where(valid[:, None] & row_ok[None, :], p, 0.0)
            ds = p * (dp - delta[None, :]) * scale
            mbarrier.wait(free, pph ^ 1)
            p_smem.index(pb).store(p.to(dtype))
            ds_smem.index(pb).store(ds.to(dtype))
            fence_async_shared()
            mbarrier.arrive(ready)

        mbarrier.wait(ready, pph)
        # dQ^T[my half] += KV^T[my half] dS^T (M = 64 columns a piece, N = HP heads, K = 64 slots).
        dst = ds_smem.index(pb)
        dq0 = warpgroup_mma(kv_smem.index(2 * WG + fresh(z)).slice(0, 64, dim=1).permute((1, 0)), dst,
                            dq0, is_async=True)
        dq1 = warpgroup_mma(kv_smem.index(2 * WG + fresh(z)).slice(64, 64, dim=1).permute((1, 0)), dst,
                            dq1, is_async=True)
        dq2 = warpgroup_mma(kv_smem.index(2 * WG + 1 + fresh(z)).slice(0, 64, dim=1).permute((1, 0)), dst,
                            dq2, is_async=True)
        dq3 = warpgroup_mma(kv_smem.index(2 * WG + 1 + fresh(z)).slice(64, 64, dim=1).permute((1, 0)), dst,
                            dq3, is_async=True)
        dq0, dq1, dq2, dq3 = warpgroup_mma_wait(num_outstanding=0, deps=(dq0, dq1, dq2, dq3))
        mbarrier.arrive(bars.index(_KV_FREE + WG))  # my kv half: the next block's gather may start
        if mine:
            offs_kz = _row_pair(offs_ks + z)
            row_ptr, on = _dkv_rows(ACC, PARTIAL, idx_row, j, z, k_end, N, offs_kz, slot0, RED, D)
            acc = _dkv_piece(p_smem.index(pb), ds_smem.index(pb), do_smem, q_smem, z, 0, HP, dkv_zero, True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            nxt = _dkv_piece(p_smem.index(pb), ds_smem.index(pb), do_smem, q_smem, z, 1, HP, dkv_zero, True)
            for i in gl.static_range(1, 8):
                if i > 1:
                    nxt = _dkv_piece(p_smem.index(pb), ds_smem.index(pb), do_smem, q_smem, i // 2 + z,
                                     i % 2, HP, dkv_zero, True)
                _send_piece(row_ptr + (((i - 1) // 2) * _QD + ((i - 1) % 2) * 64), offs_dd, acc, on, False,
                            0, RED, EVICT_LAST)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, ))
            mbarrier.arrive(free)  # P^T and dS^T read for the last time
            _send_piece(row_ptr + (3 * _QD + 64), offs_dd, acc, on, False, 0, RED, EVICT_LAST)
        else:
            mbarrier.arrive(free)  # (my dQ read dS^T for the last time)

    # dQ out: my four [64 columns, HP] pieces, transposed into my two q quarters' first HP
    # rows once the last block's owner has read them, then by TMA (heads past H are not
    # written), or stored from registers.
    _wait_last_block_read(bars, g0, nb_t, SPLIT)
    if DQ_TMA == 1:
        _stage_dq_t(q_smem, 2 * WG, 0, dq0, HP)
        _stage_dq_t(q_smem, 2 * WG, 64, dq1, HP)
        _stage_dq_t(q_smem, 2 * WG + 1, 0, dq2, HP)
        _stage_dq_t(q_smem, 2 * WG + 1, 64, dq3, HP)
        _send_dq_tma(DQ, q_smem, pid_t, gl.to_tensor(0), WG)  # (one head block)
        mbarrier.arrive(bars.index(_QD_FREE))
    else:
        mbarrier.arrive(bars.index(_QD_FREE))
        h_c = gl.arange(0, HP, layout=head_l)
        d_c = gl.arange(0, 64, layout=slot_l)
        dq_ptrs = (DQ + pid_t * stride_gt + h_c[None, :].to(gl.int64) * stride_gh
                   + (WG * 2 * _QD + d_c)[:, None])
        h_ok = (h_c < H)[None, :]
        gl.store(dq_ptrs, dq0.to(DQ.dtype.element_ty), mask=h_ok)
        gl.store(dq_ptrs + 64, dq1.to(DQ.dtype.element_ty), mask=h_ok)
        gl.store(dq_ptrs + _QD, dq2.to(DQ.dtype.element_ty), mask=h_ok)
        gl.store(dq_ptrs + (_QD + 64), dq3.to(DQ.dtype.element_ty), mask=h_ok)


@gluon.jit
def _heads_t(smem, quarter, HP: gl.constexpr):
    """The first HP head rows of D quarter ``quarter`` of q or dO, transposed: [128, HP]."""
    return smem.index(quarter).slice(0, HP, dim=0).permute((1, 0))


@gluon.jit
def _qk_t(kv_smem, a_smem, quarter, acc, HP: gl.constexpr, use_acc: gl.constexpr = True):
    """acc + kv[quarter] a[quarter]^T over the first HP heads of q or dO, issued asynchronously;
    the quarter's index formed here (``_qk``)."""
    return warpgroup_mma(kv_smem.index(fresh(quarter)), _heads_t(a_smem, fresh(quarter), HP), acc,
                         use_acc=use_acc, is_async=True)


@gluon.jit
def _stage_dq_t(q_smem, quarter, col0: gl.constexpr, dqt, HP: gl.constexpr):
    """dQ^T's [64 columns, HP heads] piece into rows [0, HP), columns [col0, col0 + 64) of q's
    D quarter ``quarter`` (the tile's [64 heads, 128] q buffer, read for the last time)."""
    rows = q_smem.index(quarter).slice(0, HP, dim=0)
    rows.slice(col0, 64, dim=1).permute((1, 0)).store(dqt.to(q_smem.dtype))


@gluon.jit
def _stamp(TR, n_tiles, rank, tcount, ev, ABL: gl.constexpr):
    """(``ABL & 16``, measurement only) The SM's cycle counter at event ``ev`` of this
    program's ``tcount``-th tile, into TR [programs, tiles a program, _N_EV] int64; with
    ``ABL & 32`` the GPU's global timer (ns, the same clock on every SM) instead."""
    # (the row in asm with side effects, so that each stamp forms its own address. A stamp
    # right after the split schedule's block loop made ptxas reload 38 values a loop, with
    # or without this: that event is stamped in _tile_dq_out, after dQ's wait for the last
    # block's pieces, instead)
    row = gl.inline_asm_elementwise(
        "{ .reg .u32 m; add.u32 m, $2, $3; sub.u32 m, m, 1; div.u32 m, m, $3; mad.lo.u32 $0, $1, m, $4; }",
        "=r,r,r,r,r", [rank, n_tiles, gl.num_programs(0), tcount], dtype=gl.int32, is_pure=False, pack=1)
    if ABL & 32:
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [row], dtype=gl.int64,
                                      is_pure=False, pack=1)
    else:
        t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [row], dtype=gl.int64,
                                      is_pure=False, pack=1)
    gl.store(TR + row.to(gl.int64) * _N_EV + ev, t)


@gluon.jit
def _opaque(x):
    """``x`` (an int32 scalar) through a PTX ``mov``: the same value, which LLVM cannot
    analyse. The block loops take their counter through it: LLVM then neither widens the
    counter to 64 bits nor strength-reduces the addresses and values formed from it into
    more loop-carried registers (Triton 3.9 spilled them: ``_consume_tile``)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _row_pair(offs):
    """``offs`` [_BK] in the wgmma accumulator's row layout, whose thread holds rows r and
    r + 8 in that order (tests/test_sm90_compile.py checks it), rebuilt from its first
    element (+ 8 for the second): one value per thread stays live across the block loop,
    not two (Triton 3.9's ptxas spilled the second)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $2;\n\tadd.s32 $1, $2, 8;", "=r,=r,r,r", [offs],
                                     dtype=gl.int32, is_pure=True, pack=2)


@gluon.jit
def _dkv_piece(p_smem, ds_smem, do_smem, q_smem, quarter, hh: gl.constexpr, HP: gl.constexpr, zero,
               TRANS: gl.constexpr = False):
    """Columns [hh*64, hh*64+64) of D quarter ``quarter`` of a block's dKV rows, issued
    asynchronously: P^T dO + dS^T Q (M = 64 slots, N = 64, K = the tile's first HP heads:
    the rows of P and dS past H are zeros, so a tile of H <= 16 or 32 heads contracts over
    16 or 32 of them, not 64). P and dS are [64 heads, 64 slots], read transposed, or
    (``TRANS``, ``_consume_tile_split_t``) already P^T and dS^T, [64 slots, HP heads]."""
    quarter = fresh(quarter)  # (formed here, not hoisted: hopper.fresh)
    if TRANS:
        a_p = p_smem
        a_ds = ds_smem
    elif HP < _BH:
        a_p = p_smem.slice(0, HP, dim=0).permute((1, 0))
        a_ds = ds_smem.slice(0, HP, dim=0).permute((1, 0))
    else:
        a_p = p_smem.permute((1, 0))
        a_ds = ds_smem.permute((1, 0))
    if HP < _BH:
        do_q = do_smem.index(quarter).slice(0, HP, dim=0)
        q_q = q_smem.index(quarter).slice(0, HP, dim=0)
    else:
        do_q = do_smem.index(quarter)
        q_q = q_smem.index(quarter)
    acc = warpgroup_mma(a_p, do_q.slice(hh * 64, 64, dim=1), zero, use_acc=False, is_async=True)
    return warpgroup_mma(a_ds, q_q.slice(hh * 64, 64, dim=1), acc, is_async=True)


@gluon.jit
def _send_piece(row_ptr, offs_d, acc, on, follower, paired, RED: gl.constexpr,
                EVICT_LAST: gl.constexpr, rows16=None, SEG: gl.constexpr = -1):
    """acc[slot, c] to row row_ptr[slot], column c: added to the fake-ordered fp32
    accumulator (``RED``; only the slots whose ``on`` is 1), or a partial row: stored, or
    (the follower of a head-block pair) added once to the leader's. Partial rows of fp16
    (``row_ptr`` an fp16 pointer: 16-bit partial rows) are stored scaled, their scales beside
    them (``rows16``: the partial rows' base and the scales', or with ``SEG`` >= 0 the
    scales' and each row's index, and the piece's segment: ``_store_16``; no head-block
    pairs)."""
    if RED:
        on_el = gl.full(acc.shape, 1, gl.int32, acc.type.layout) * on[:, None]
        if RED == 7:  # the deterministic mode's exact two-word sums (``on``: the rows' codes)
            red_f32x4_lines_exact(fake_group_base(row_ptr, offs_d), acc, on_el)
        elif RED == 6:  # (ablation 256, timing only: fp32 lines of values rounded to a grid)
            red_f32x4_lines_grid(fake_group_base(row_ptr, offs_d), acc, on_el)
        elif RED >= 4:  # (ablation 64, timing only: two s32 words a 64-bit add; 5: unconverted)
            red_s32x2_lines(fake_group_base(row_ptr, offs_d), acc, on_el, RED == 4)
        elif RED >= 2:  # whole 128-byte lines per instruction
            red_f32x4_lines(fake_group_base(row_ptr, offs_d), acc, on_el, EVICT_LAST)
        else:
            red_f32x4_fake(fake_group_base(row_ptr, offs_d), acc, on_el)
    elif row_ptr.dtype.element_ty == gl.bfloat16:  # (bf16 rows, unscaled: a measurement option)
        # (``rows16`` = (rows, N >= 0): a predicate true at run time that the compiler cannot
        # fold; with one it can (a constant, or the program id), ptxas serialised the wgmmas
        # reading the accumulator straight into the stores, and spilled: sm_90, Triton 3.6)
        keep = gl.full(acc.shape, 1, gl.int32, acc.type.layout) * rows16[1].to(gl.int32)
        st_bf16x4_fake(fake_group_base(row_ptr, offs_d), acc, keep)
    elif row_ptr.dtype.element_ty == gl.float16:  # (a compile-time choice: the rows' type)
        if len(rows16) == 4:  # (ablation 512, timing only: no store instructions)
            pass
        elif len(rows16) > 2:  # (ablations 8 and 1024: timing only)
            _store_16_ablated(row_ptr, offs_d, acc, rows16[0], rows16[1], rows16[2], len(rows16) == 5)
        else:
            _store_16(row_ptr, offs_d, acc, rows16[0], rows16[1], SEG)
    else:  # partial rows, in the same fake column order (16-byte stores and adds)
        ones = gl.full(acc.shape, 1, gl.int32, acc.type.layout)
        gb = fake_group_base(row_ptr, offs_d)
        if follower:
            red_f32x4_fake(gb, acc, ones)
        elif paired:  # the follower adds to these rows shortly: keep them in L2
            st_f32x4_fake(gb, acc, ones, False)
        else:  # streaming: each partial row is read once, by the reduction (+5%)
            st_f32x4_fake(gb, acc, ones, True)


@gluon.jit
def _scale_bytes(row_ptr, PARTIAL, EXP):
    """The scale bytes of the 64-column segments that start at ``row_ptr`` (D = 512: 1024-byte
    rows of 8 segments, one 8-byte scale word a row, so a segment's byte sits at its byte
    offset in the rows / 128)."""
    return EXP.to(gl.pointer_type(gl.uint8)) + ((row_ptr.to(gl.int64) - PARTIAL.to(gl.int64)) >> 7)


@gluon.constexpr_function
def _seg16(col, rope):
    """The scale byte of the 64-column segment at value column ``col`` of a 576-column
    16-bit row (two scale words a row: bytes 0-7 the 64-column segments, 8 and 9 the
    score-only columns' halves, one a consumer: ``backward._scaled``'s layout); -1 (from
    the piece's address) without score-only columns."""
    return col // 64 if rope else -1


@gluon.jit
def _segment_scale(acc):
    """Each row's scale exponent s of a piece's segment (its largest |value| to [2^14, 2^15),
    s in [-126, 126], 0 for a zero segment) and 2^-s (exact): ``_store_16``'s scaling."""
    big = gl.max(gl.abs(acc), axis=1)
    e = ((big.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2) of a normal max
    s = gl.where(big == 0.0, 0, gl.minimum(gl.maximum(e - 14, -126), 126))
    return s, ((127 - s) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _store_16(row_ptr, offs_d, acc, PARTIAL, EXP, SEG: gl.constexpr = -1):
    """A [64 slots, 64 columns] piece (or [64, 32]: a consumer's half of the 576/512
    layout's score-only columns) to 16-bit partial rows
    (docs/performance/backward.md#partial-rows-in-16-bits): each slot's columns (one
    segment of its row) scaled by 2^-s so that their largest |value| lies in [2^14, 2^15)
    (s in [-126, 126]; 0 for a zero segment), stored as fp16 in fake column order
    (``st_f16x4_fake``), and s + 127 as the segment's byte of the scales
    (``backward._scaled``: int64 words, a byte a segment; ``_scale_bytes`` at D = 512,
    else byte ``SEG`` of the row whose index ``EXP`` holds). The row's maximum is a
    quad's: its 4 lanes hold the row's columns (two shuffles)."""
    s, inv = _segment_scale(acc)
    ones = gl.full(acc.shape, 1, gl.int32, acc.type.layout)
    st_f16x4_fake(fake_group_base(row_ptr, offs_d), acc * inv[:, None], ones)
    if SEG < 0:  # (D = 512: from the row's address)
        gl.store(_scale_bytes(row_ptr, PARTIAL, EXP), (s + 127).to(gl.uint8))
    else:  # (576 columns: PARTIAL the scales, EXP each row's index; two words a row)
        scales = PARTIAL.to(gl.pointer_type(gl.uint8))
        gl.store(scales + (EXP.to(gl.int64) * 16 + SEG), (s + 127).to(gl.uint8))


@gluon.jit
def _store_16_ablated(row_ptr, offs_d, acc, PARTIAL, EXP, KEEP, UNSCALED: gl.constexpr):
    """``_store_16`` at D = 512 with parts taken out (``launch(ablate=...)``, timing only: the
    rows are then wrong): every store predicated off by ``KEEP`` (a run-time flag, false;
    ablation 8) and, with ``UNSCALED`` (1024), no scaling either (the values converted as
    they are). (Ablation 512, no store instructions at all, is ``_send_piece``'s.)"""
    ones = gl.full(acc.shape, 1, gl.int32, acc.type.layout) * KEEP.to(gl.int32)
    if UNSCALED:
        st_f16x4_fake(fake_group_base(row_ptr, offs_d), acc, ones)
    else:
        s, inv = _segment_scale(acc)
        st_f16x4_fake(fake_group_base(row_ptr, offs_d), acc * inv[:, None], ones)
        gl.store(_scale_bytes(row_ptr, PARTIAL, EXP), (s + 127).to(gl.uint8), mask=(s > -1000) & KEEP)


@gluon.jit
def _consume_tile(io, sizes, strides, smem, scales, nb, nb_t, g0, k_end, pid_c, pid_t, pid_h, n_hb, tcount,
                  paired, n_tiles, rank, WG: gl.constexpr, RED: gl.constexpr, HAS_LEN: gl.constexpr,
                  ROPE: gl.constexpr, EVICT_LAST: gl.constexpr, DQ_TMA: gl.constexpr, ABL: gl.constexpr,
                  HP: gl.constexpr, PARTS: gl.constexpr = False, PAIRS: gl.constexpr = True,
                  SORTED: gl.constexpr = 0):
    """One (token, 64-head block) tile of consumer ``WG`` (0 or 1): slot blocks 0..nb_t-1
    (the first of them the barriers' ``g0``-th), ids past slot ``k_end`` masked; ``nb``
    blocks per token in the partial-row buffer. ``SORTED``: 16-bit partial rows at their
    ranks (the producer's ``rank_smem``: ``backward.FOLD_IN_MAIN``), one part a head block."""
    IDX, LSE, DELTA, DQ, ACC, PARTIAL, FLAGS, LEN, ORDER, DQR, TR, DQP, EXP, PART = io
    H, N, K = sizes
    stride_it, stride_lt, stride_gt, stride_gh = strides
    q_smem, do_smem, kv_smem, qr_smem, kvr_smem, p_smem, ds_smem, bars, rank_smem = smem
    scale, scale_log2 = scales
    D: gl.constexpr = 4 * _QD + ROPE  # a dKV / partial row: the value columns, then the rope ones
    dtype: gl.constexpr = q_smem.dtype

    row_ok, lse2, delta, offs_c, offs_dd, offs_ks, idx_row, s_zero, dq_zero, dkv_zero = _tile_start(
        LSE, DELTA, IDX, H, pid_t, pid_h, stride_lt, stride_it, ABL)
    dq0 = dq_zero
    dq1 = dq_zero
    # ROPE: consumer WG owns the rope columns [32 WG, 32 WG + 32) of dQ and of the dKV rows.
    # Its dQ part is summed in this program's fp32 scratch rows DQR[rank] (64 heads x 64),
    # not in registers: 16 more live registers a thread made ptxas serialise the wgmmas and
    # reload 8 spilled values per block. The rows are in fake column order, so a thread adds
    # its four values of a row in a 16-column group with one 16-byte reduction
    # (red_f32x4_fake: 4 a block instead of 16 scalar atomics). One thread adds to each
    # scratch element, block after block, so the sum's order is fixed (deterministic).
    r_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 32, 16])
    r_zero = gl.zeros([_BK, 32], gl.float32, layout=r_l)
    offs_r32 = gl.arange(0, 32, layout=gl.SliceLayout(0, r_l))
    h_r = gl.arange(0, _BH, layout=gl.SliceLayout(1, r_l))
    dqr_base = DQR + rank.to(gl.int64) * (_BH * 64) + 32 * WG
    r_ones = gl.full([_BK, 32], 1, gl.int32, r_l)
    # Deterministic path with head blocks in pairs (``paired``, n_hb even): the even
    # block of a pair stores its partial rows and counts, per consumer, the slot blocks
    # it has published; the odd one waits for that count and adds its rows with one
    # fp32 atomic each. Two addends: a + b is the same whichever lands first, so the
    # result is bitwise deterministic, with one partial row per (token, slot) instead
    # of two. The pair's tiles run side by side on neighbouring programs.
    # The follower also counts the blocks it has added, and the leader stays at most
    # _LAG blocks ahead of that count. Unpaced, the leader (plain stores) ran ahead of
    # the follower (atomics) by whole tiles: its rows left L2 before the follower's adds
    # reached them, most adds became an HBM read and a second HBM write (ncu, one chunk
    # at H128 K1152: 1.86 GB written and 0.91 GB read for 0.93 GB of partial rows; paced:
    # 1.00 and 0.14), and leader programs sat idle at the end of each chunk. With
    # _LAG = 0 the leader starts block j once the follower has added block j-1, which
    # needs only the leader's block j-1: no cycle. The leader waits only once its partner
    # program has taken its ticket (so is running, and waits on no one but this leader):
    # no deadlock even if not all the kernel's programs are resident at once.
    # (pairs are a partial-row path only. PAIRS False folds their flags to constants, so their
    # code goes: under Triton 3.9 that leaves 5-6 spill reloads per fast-mode block loop
    # instead of 50-51 (17-19 against 56 before the opaque block counter); under 3.6-3.7 it
    # adds one, so there the flags stay runtime zeros: backward_gluon._pairs_code.)
    follower, leader, slot0, flag_base = _pair_roles(FLAGS, paired, pid_c, pid_h, n_hb, nb, offs_ks, RED,
                                                     PAIRS)
    flag_ptr = flag_base + WG
    done_ptr = flag_ptr + n_tiles  # the follower's count of added blocks
    pace = leader & (gl.atomic_add(FLAGS, 0, sem="relaxed", scope="gpu") > rank + 1)

    mbarrier.wait(bars.index(_QD_READY), tcount & 1)
    if ABL & 16:
        _stamp(TR, n_tiles, rank, tcount, _EV_C_QD + 4 * WG, ABL)
    for jj in range(0, nb_t):
        # (j opaque: the loop carries only its counter. With j itself, Triton 3.9's LLVM
        # widened the counter to 64 bits and kept g, z and the ids offsets as loop-carried
        # registers of their own, which ptxas spilled: 17 / 19 reloads per fast-mode block
        # loop instead of 8 / 9; 3.6-3.8 unchanged)
        j = _opaque(jj)
        g = g0 + j
        ph = g & 1
        # z is 0 (0 <= j < 2^31) but unknown to the compiler: the shared-memory descriptors
        # (kv, q, dO, P, dS) are formed in the loop instead of hoisted out of it and
        # spilled. A spilled value's reload queues behind this warp group's dKV stores in
        # the L1 pipeline, so the next block would wait for the stores to drain (ncu: 53%
        # of stalls on L1TEX scoreboards; -8% backward time once P and dS got this too).
        # (It was j * program_id(2), grid z = 1: that kept the program id live, and spilled
        # under Triton 3.9.)
        z = j >> 31
        if g % 2 == WG:  # my block: S, dP, P and dS
            ids = load_ids(idx_row, j * _BK, k_end, offs_c)  # (the bound: see the load of ids_k below)
            p, ds = _scores(q_smem, do_smem, kv_smem, qr_smem, kvr_smem, bars, z, ph, ids, N, s_zero, scale,
                            scale_log2, lse2, row_ok, delta, ROPE)
            # (Unlike the Triton kernel, no mask on dS past the token's length: it cost 4-5
            # spill reloads per block under Triton 3.6. A slot there has P = 0 and a zero kv
            # row, so its dS is 0 unless Delta is not finite, and then every slot of the
            # visited block, which holds at least one slot within the length, already makes
            # this dQ row NaN.)
            # Publish once both consumers are done with the previous block's P and dS.
            mbarrier.wait(bars.index(_PDS_FREE), ph ^ 1)
            p_smem.index(z).store(p.to(dtype))
            ds_smem.index(z).store(ds.to(dtype))
            fence_async_shared()
            mbarrier.arrive(bars.index(_PDS_READY))

        mbarrier.wait(bars.index(_PDS_READY), ph)
        # dQ[:, my half] += dS KV[:, my half] (scale is folded into dS).
        dq0 = warpgroup_mma(ds_smem.index(z), kv_smem.index(2 * WG + fresh(z)), dq0, is_async=True)
        dq1 = warpgroup_mma(ds_smem.index(z), kv_smem.index(2 * WG + 1 + fresh(z)), dq1, is_async=True)
        if ROPE > 0:
            dqp = warpgroup_mma(ds_smem.index(z), kvr_smem.index(z).slice(32 * WG, 32, dim=1), r_zero,
                                use_acc=False, is_async=True)
            dq0, dq1, dqp = warpgroup_mma_wait(num_outstanding=0, deps=(dq0, dq1, dqp))
            mbarrier.arrive(bars.index(_KVR_FREE))
            mbarrier.arrive(bars.index(_KV_FREE + WG))  # my kv half: the next block's gather may start
            red_f32x4_fake(fake_group_base(dqr_base + z + h_r * 64, offs_r32), dqp, r_ones)
        else:
            dq0, dq1 = warpgroup_mma_wait(num_outstanding=0, deps=(dq0, dq1))
            mbarrier.arrive(bars.index(_KV_FREE + WG))  # my kv half: the next block's gather may start

        # dKV rows of this block for my half of D, a quarter at a time: P^T dO + dS^T Q
        # (M = 64 slots, N = 128 columns, K = 64 heads; P and dS read transposed).
        # (offsets built from z stay in the loop: hoisted, they would spill; the second row's
        # from the first's, in the loop too)
        offs_kz = _row_pair(offs_ks + z)
        if SORTED:  # (the block's ranks, from the producer: rows rank x parts + my head block)
            rk = rank_smem.index(g & 1).load(gl.SliceLayout(1, _S_L))
            row_ptr = PARTIAL + (rk * n_hb + pid_h).to(gl.int64) * D
            on = offs_kz
        else:
            row_ptr, on = _dkv_rows(ACC, PARTIAL, idx_row, j, z, k_end, N, offs_kz, slot0, RED, D, ABL)
        rows16 = (PARTIAL, EXP)  # (16-bit rows' scales: D = 512, from each piece's address)
        if PARTIAL.dtype.element_ty == gl.bfloat16:  # (bf16 rows: no scales; see _send_piece)
            rows16 = (PARTIAL, N >= 0)
        elif ABL & 512:  # (fp16 rows, timing only: the tuple's length picks the ablation in
            rows16 = (PARTIAL, EXP, N < 0, 0)  # ``_send_piece``)
        elif ABL & 1024:
            rows16 = (PARTIAL, EXP, N < 0, 0, 0)
        elif ABL & 8:
            rows16 = (PARTIAL, EXP, N < 0)
        if ROPE > 0:
            if PARTIAL.dtype.element_ty == gl.float16:  # (576: each row's index, its scales' word pair)
                rows16 = (EXP, _row_pair(slot0 + (j ^ z) * _BK))
        # Four 64-column pieces (32 registers each next to dQ's 128); each piece's adds
        # are issued while the next piece's wgmma runs.
        acc = _dkv_piece(p_smem.index(z), ds_smem.index(z), do_smem, q_smem, 2 * WG + z, 0, HP, dkv_zero)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        nxt = _dkv_piece(p_smem.index(z), ds_smem.index(z), do_smem, q_smem, 2 * WG + z, 1, HP, dkv_zero)
        if follower:  # the leader's rows of this block must be in place before I add to them
            while gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu") <= j:
                pass
        if pace:  # no more than _LAG blocks ahead of the follower's adds
            while gl.atomic_add(done_ptr, 0, sem="relaxed", scope="gpu") < j - _LAG:
                pass
        _send_piece(row_ptr + (2 * WG * _QD), offs_dd, acc, on, follower, paired, RED, EVICT_LAST,
                    rows16, _seg16(2 * WG * _QD, ROPE))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, ))
        nxt = _dkv_piece(p_smem.index(z), ds_smem.index(z), do_smem, q_smem, 2 * WG + 1 + z, 0, HP, dkv_zero)
        _send_piece(row_ptr + (2 * WG * _QD + 64), offs_dd, acc, on, follower, paired, RED, EVICT_LAST,
                    rows16, _seg16(2 * WG * _QD + 64, ROPE))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, ))
        nxt = _dkv_piece(p_smem.index(z), ds_smem.index(z), do_smem, q_smem, 2 * WG + 1 + z, 1, HP, dkv_zero)
        _send_piece(row_ptr + ((2 * WG + 1) * _QD), offs_dd, acc, on, follower, paired, RED, EVICT_LAST,
                    rows16, _seg16((2 * WG + 1) * _QD, ROPE))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, ))
        if ROPE > 0:  # my 32 rope columns of the rows: dS^T Q_rope (no value term)
            rop = warpgroup_mma(ds_smem.index(z).permute((1, 0)), qr_smem.index(z).slice(32 * WG, 32, dim=1),
                                r_zero, use_acc=False, is_async=True)
            _send_piece(row_ptr + ((2 * WG + 1) * _QD + 64), offs_dd, acc, on, follower, paired, RED,
                        EVICT_LAST, rows16, _seg16((2 * WG + 1) * _QD + 64, ROPE))
            rop = warpgroup_mma_wait(num_outstanding=0, deps=(rop, ))
            mbarrier.arrive(bars.index(_PDS_FREE))  # P and dS read for the last time
            rows_r = gl.convert_layout(row_ptr, gl.SliceLayout(1, r_l))  # (the same rows: no data moves)
            on_r = gl.convert_layout(on, gl.SliceLayout(1, r_l))
            rows16_r = rows16
            if PARTIAL.dtype.element_ty == gl.float16:  # (my half of the score-only columns: byte 8 + WG)
                rows16_r = (EXP, gl.convert_layout(rows16[1], gl.SliceLayout(1, r_l)))
            _send_piece(rows_r + (4 * _QD + 32 * WG), offs_r32, rop, on_r, follower, paired, RED,
                        EVICT_LAST, rows16_r, 8 + WG)
        else:
            mbarrier.arrive(bars.index(_PDS_FREE))  # P and dS read for the last time
            _send_piece(row_ptr + ((2 * WG + 1) * _QD + 64), offs_dd, acc, on, follower, paired, RED,
                        EVICT_LAST, rows16)
        if leader:  # publish: every thread's stores of this block, then the count (release)
            thread_barrier()
            gl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")
        if follower:  # (pacing only: no ordering needed)
            gl.atomic_add(done_ptr, 1, sem="relaxed", scope="gpu")

    _tile_dq_out(DQ, dq0, dq1, H, pid_t, pid_h, stride_gt, stride_gh, q_smem, bars, g0, nb_t, WG, 0,
                 DQ_TMA, ABL, TR, n_tiles, rank, tcount, PART, PARTS)
    if ROPE > 0:  # my rope columns of dQ: taken from the scratch, which is left zero
        # (column c of the scratch row sits at fake_col(c); relaxed: the adds above are this
        # thread's own)
        f32 = (offs_r32 // 16) * 16 + ((offs_r32 & 7) // 2) * 4 + ((offs_r32 // 8) & 1) * 2 + (offs_r32 & 1)
        dqr = gl.atomic_xchg(dqr_base + h_r[:, None] * 64 + f32[None, :], r_zero, sem="relaxed")
        hg = pid_h * _BH + h_r
        if DQ_TMA:  # (DQ is then grad_q's tensor descriptor; DQP the same tensor as a pointer)
            dq_base = DQP
        else:
            dq_base = DQ
        dqr_ptrs = (dq_base + pid_t * stride_gt + hg[:, None].to(gl.int64) * stride_gh + 4 * _QD + 32 * WG
                    + offs_r32[None, :])
        gl.store(dqr_ptrs, dqr.to(dq_base.dtype.element_ty), mask=(hg < H)[:, None])


# Runtime integers (no recompile per T, N, H or K; as in the Triton main kernel), plus the
# chunk's tile count and the pairing switch.
_RUNTIME_INTS = ["H", "N", "K", "t_begin", "n_tiles", "paired", "n_units", "n_full", "n_parts", "fold_count",
                 "fold_ahead", "chain_c", "need_t", "need_f2", "need_f3", "stride_it", "stride_lt"]


@gluon.jit(do_not_specialize=_RUNTIME_INTS)
def _bwd_main_gluon_kernel(
    Q, KV, IDX, DO, LSE, DELTA, DQ, ACC, PARTIAL, FLAGS, LEN, ORDER, DQR, TR, DQP, DQF, EXP,
    RANK, FSID, FSEG, FP, FE, SYNC,
    H, N, K, t_begin, n_tiles, paired, n_units, n_full, n_parts, fold_count, fold_ahead,
    chain_c, need_t, need_f2, need_f3,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_dt, stride_dh,
    stride_lt, stride_gt, stride_gh,
    scale, scale_log2,
    D: gl.constexpr,
    RED: gl.constexpr,
    HAS_LEN: gl.constexpr,
    ROPE: gl.constexpr = 0,
    EVICT_LAST: gl.constexpr = False,
    SPLIT: gl.constexpr = 0,
    QD_TMA: gl.constexpr = False,
    QD_EARLY: gl.constexpr = 0,
    DQ_TMA: gl.constexpr = 0,
    ABL: gl.constexpr = 0,
    HP: gl.constexpr = 64,
    TRANS: gl.constexpr = False,
    PARTS: gl.constexpr = False,
    PAIRS: gl.constexpr = True,
    PDL: gl.constexpr = 0,
    SORTED: gl.constexpr = 0,
    FOLD_E: gl.constexpr = 0,
    FOLD_S: gl.constexpr = 2,
    FOLD_NP: gl.constexpr = 1,
):
    gl.static_assert(D == 4 * _QD, "the Gluon backward takes D = 512 value columns")
    gl.static_assert(not SORTED or (RED == 0 and ROPE == 0 and SPLIT == 0 and not QD_TMA and not TRANS
                                    and HAS_LEN != 2),
                     "partial rows at their ranks: deterministic, D = 512, unsplit, q and dO by cp.async")
    gl.static_assert(FOLD_E == 0 or SORTED != 0, "the fold in the producer: partial rows at their ranks")
    gl.static_assert(SYNC.dtype.element_ty != gl.int32 or (SORTED != 0 and PDL == 3),
                     "chained launches (SYNC int32): rows at their ranks; PDL 3")
    gl.static_assert(ROPE == 0 or ROPE == 64, "score-only columns: none or 64 (the 576/512 layout)")
    gl.static_assert(not SPLIT or ROPE == 0, "split roles: D = 512 (no score-only columns)")
    gl.static_assert(RED != 7 or (ROPE == 0 and not EVICT_LAST), "exact sums: D = 512, no evict-last")
    gl.static_assert(not QD_TMA or ROPE == 0, "q and dO by TMA: D = 512 (no score-only columns)")
    gl.static_assert(QD_EARLY == 0 or (QD_TMA and SPLIT > 0 and (QD_EARLY == 2 or QD_EARLY == 3)),
                     "q and dO released early: 2 or 3 quarters, by TMA, split schedules")
    gl.static_assert(not DQ_TMA or (QD_EARLY == 0 and (ROPE == 0 or not SPLIT)),
                     "dQ by TMA: q's quarters not released early; with score-only columns, unsplit")
    gl.static_assert(DQ_TMA == 0 or DQ_TMA == 1, "dQ by TMA: 0 (plain stores) or 1 (through q's quarters)")
    gl.static_assert(not PARTS or (RED != 0 and not HAS_LEN and ROPE == 0 and not TRANS),
                     "the remainder's tiles in parts: the fast mode, no lengths, D = 512, untransposed")
    gl.static_assert(not TRANS or (HP < _BH and SPLIT > 0 and ROPE == 0 and QD_EARLY == 0 and ABL == 0),
                     "transposed small-head tiles: H <= 32, split schedules, D = 512, no early release")
    if QD_TMA:
        dtype: gl.constexpr = Q.dtype
    else:
        dtype: gl.constexpr = Q.dtype.element_ty
    quarter_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _QD], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _BK], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [4, _BH, _QD], quarter_sl)  # [D quarter]
    do_smem = gl.allocate_shared_memory(dtype, [4, _BH, _QD], quarter_sl)
    kv_smem = gl.allocate_shared_memory(dtype, [4, _BK, _QD], quarter_sl)
    # P and dS carry a unit leading dim so the consumers address them as .index(z) (see
    # _consume_tile): hoisted out of the block loop, their descriptors were spilled, and
    # each block's first reload waited behind the previous block's dKV stores.
    if TRANS:  # P^T and dS^T: [64 slots, HP heads]
        pt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BK, HP], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [1 + (SPLIT == 2), _BK, HP], pt_sl)
        ds_smem = gl.allocate_shared_memory(dtype, [1 + (SPLIT == 2), _BK, HP], pt_sl)
    else:
        p_smem = gl.allocate_shared_memory(dtype, [1 + (SPLIT == 2), _BH, _BK], p_sl)
        ds_smem = gl.allocate_shared_memory(dtype, [1 + (SPLIT == 2), _BH, _BK], p_sl)
    if ROPE > 0:  # q's and the kv block's 64 score-only columns (16 KB: 229 KB in all)
        qr_smem = gl.allocate_shared_memory(dtype, [1, _BH, ROPE], p_sl)
        kvr_smem = gl.allocate_shared_memory(dtype, [1, _BK, ROPE], p_sl)
    else:  # (never read)
        qr_smem = p_smem
        kvr_smem = ds_smem
    if SORTED:  # two blocks' ranks (the block's parity), filled by the producer's cp.async
        rank_smem = gl.allocate_shared_memory(gl.int32, [2, _BK], fold_flat1)
    else:  # (never read)
        rank_smem = p_smem
    if FOLD_E > 0:  # the fold's ring (fold_gluon)
        f_buf, f_words = fold_smem(FOLD_E, FOLD_S, FOLD_NP)
    else:  # (never read)
        f_buf = p_smem
        f_words = ds_smem
    if QD_EARLY > 0:
        bars = gl.allocate_shared_memory(gl.int64, [_N_BARS + 1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bars.index(_QD_FREE_EARLY), count=2)
    else:
        bars = gl.allocate_shared_memory(gl.int64, [_N_BARS, 1], mbarrier.MBarrierLayout())
    # cp.async arrivals of the producer's threads, or the TMA tiles' expect
    mbarrier.init(bars.index(_QD_READY), count=1 if QD_TMA else 128)
    mbarrier.init(bars.index(_QD_FREE), count=2)
    for i in gl.static_range(2):
        mbarrier.init(bars.index(_KV_READY + i), count=128)
        mbarrier.init(bars.index(_KV_FREE + i), count=1)
    mbarrier.init(bars.index(_PDS_READY), count=1)
    mbarrier.init(bars.index(_PDS_FREE), count=2)
    if SPLIT == 2:
        for i in gl.static_range(2):
            mbarrier.init(bars.index(_PDS2_READY + i), count=1)
            mbarrier.init(bars.index(_PDS2_FREE + i), count=2)
    mbarrier.init(bars.index(_KVR_FREE), count=2)

    nb = gl.cdiv(K, _BK)
    # Programs take their rank from a ticket counter (FLAGS[0], zero at launch), not from
    # program_id: the program holding a pair's odd tile then knows the one holding the
    # even tile (the rank below) has started, so its wait always ends.
    rank = gl.atomic_add(FLAGS, 1, sem="relaxed")
    if PDL == 1 or PDL == 3:  # the launch after this one (PDL 2, 3) may start on the SMs this grid leaves
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0 $1", "=r,r", [rank],
                                  dtype=gl.int32, is_pure=False, pack=1)
    sizes = (H, N, K)
    c_args = ((IDX, LSE, DELTA, DQ, ACC, PARTIAL, FLAGS, LEN, ORDER, DQR, TR, DQP, EXP), sizes,
              (stride_it, stride_lt, stride_gt, stride_gh),
              (q_smem, do_smem, kv_smem, qr_smem, kvr_smem, p_smem, ds_smem, bars, rank_smem),
              (scale, scale_log2), t_begin, n_tiles, nb, rank, paired,
              (n_units, n_full, n_parts, DQF) if PARTS else (n_units, ), (SYNC, chain_c, need_f3))
    p_args = ((Q, DO, KV, IDX, LEN, ORDER, TR, (n_units, n_full, n_parts), (RANK, FSID, FSEG, FP, FE, ACC,
                                                                            (SYNC, chain_c, need_t, need_f2),
                                                                            fold_count, fold_ahead)), sizes,
              (stride_qt, stride_qh, stride_dt, stride_dh, stride_kvn, stride_it),
              (q_smem, do_smem, kv_smem, qr_smem, kvr_smem, bars, rank_smem, f_buf, f_words), t_begin,
              n_tiles, nb, rank, HAS_LEN, ABL)
    # The producer is the default partition (ptxas compiles it under MAXNREG; the
    # consumers get setmaxnreg budgets).
    if ROPE > 0:
        gl.warp_specialize([(_producer_rope, p_args),
                            (_consumer, (c_args, 0, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 0, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS)),
                            (_consumer, (c_args, 1, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 0, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS))],
                           [PARTITION_WARPS, PARTITION_WARPS], [PARTITION_REGS, PARTITION_REGS])
    elif QD_EARLY == 2:
        gl.warp_specialize([(_producer_qd_early2, p_args),
                            (_consumer, (c_args, 0, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 2, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS)),
                            (_consumer, (c_args, 1, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 2, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS))],
                           [PARTITION_WARPS, PARTITION_WARPS], [PARTITION_REGS, PARTITION_REGS])
    elif QD_EARLY == 3:
        gl.warp_specialize([(_producer_qd_early3, p_args),
                            (_consumer, (c_args, 0, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 3, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS)),
                            (_consumer, (c_args, 1, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 3, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS))],
                           [PARTITION_WARPS, PARTITION_WARPS], [PARTITION_REGS, PARTITION_REGS])
    elif QD_TMA:
        gl.warp_specialize([(_producer_qd_tma, p_args),
                            (_consumer, (c_args, 0, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 0, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS)),
                            (_consumer, (c_args, 1, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 0, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS))],
                           [PARTITION_WARPS, PARTITION_WARPS], [PARTITION_REGS, PARTITION_REGS])
    elif SORTED:  # (with the fold the consumers at FOLD_CONSUMER_REGS, the producer at the rest)
        C_REGS: gl.constexpr = FOLD_CONSUMER_REGS if FOLD_E > 0 else PARTITION_REGS
        gl.warp_specialize([(_producer_sorted, p_args),
                            (_consumer, (c_args, 0, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 0, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS, 1)),
                            (_consumer, (c_args, 1, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 0, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS, 1))],
                           [PARTITION_WARPS, PARTITION_WARPS], [C_REGS, C_REGS])
    else:
        gl.warp_specialize([(_producer, p_args),
                            (_consumer, (c_args, 0, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 0, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS)),
                            (_consumer, (c_args, 1, RED, HAS_LEN, ROPE, EVICT_LAST, SPLIT, 0, DQ_TMA, ABL,
                                         HP, TRANS, PARTS, PAIRS))],
                           [PARTITION_WARPS, PARTITION_WARPS], [PARTITION_REGS, PARTITION_REGS])
    if PDL >= 2:  # (launched early beside the grid before it) ends only after that grid has
        # ended and its writes are visible, so the launches after this one see both
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,r", [rank],
                                  dtype=gl.int32, is_pure=False, pack=1)


def rejects(call) -> str | None:
    """Why this kernel does not run the backward's main work for ``call`` (None: it does).

    Its whole rule: ``hopper.hopper_rejects`` (a Triton with Gluon's Hopper API, an sm_90
    GPU, bf16/fp16 and D = 512), at any H, in both modes: below 64 heads a tile's other
    rows are masked (the dKV products contract over 16 or 32 heads where H allows:
    ``_head_pad``; the fast mode transposes such tiles: ``_transposed``), and the backward
    is bound by its dKV traffic, which does not depend on H (at H = 16, K = 1152
    it takes 20% less time than the Triton kernel in the fast mode and 11% less in the
    deterministic one: docs/performance/backward.md#small-head-counts).

    Also the 576/512 layout (D = 576, d_v = 512), on every Triton: from 3.8 on ptxas
    serialises that build's wgmmas and 3.9 reloads spilled values in its block loops
    (tests/test_sm90_compile.py); under 3.9 it still runs at 1.4-1.6x the Triton main
    kernel in the fast mode and 1.3-1.4x in the deterministic one (H200; 3.8 not timed:
    docs/performance/backward.md#the-576512-layout-in-the-gluon-main-kernel).
    """
    return hopper_rejects(call, v32=True)


def partial_slots(K: int) -> int:
    """Slots per token of the partial-row buffer: whole 64-slot blocks (unmasked stores)."""
    return triton.cdiv(K, BLOCK_K) * BLOCK_K


# 16-bit partial rows by default where they were timed, by Triton: the (q width, value
# columns) layouts. H100, 2026-12-06: under 3.6 at D = 512 and 576/512 (19-30% and 1-24%
# less deterministic time); under 3.9 at D = 512 (13-30% less), not at 576/512 (14% less at
# H = 64, 4% more at H = 128, where 3.9's 16-bit main kernel is slower).
PARTIAL_16_LAYOUTS = {(3, 6): ((512, 512), (576, 512)), (3, 9): ((512, 512),)}


def partial16_default(W: int, D: int) -> bool:
    """Whether the deterministic mode's partial rows are 16-bit by default
    (``backward.PARTIAL_16``) for q width W and D value columns: where ``launch``
    has them and they were timed under the running Triton (``PARTIAL_16_LAYOUTS``: D = d_v =
    512 and the 576/512 layout under 3.6, D = 512 under 3.9), at any H. (With 16-bit rows
    the head blocks do not pair; at H = 128 the two fp16 rows an entry took less time than
    one fp32 row: H100, 11.5 against 12.8 ms at K = 1152, 15.5 against 15.9 at 576/512; at
    576/512 19% less at H = 64 and 23-24% at H = 16 and 32, K = 1152.)"""
    return (W, D) in PARTIAL_16_LAYOUTS.get(TRITON_VERSION, ())


def folds_in_main(W: int, D: int) -> bool:
    """Whether ``launch`` takes the previous chunk's fold (``fold``, with ``ranks``) for q width
    W and D value columns: D = d_v = 512 (``backward.FOLD_IN_MAIN``)."""
    return W == D == 512


def pairs_head_blocks(n_hb: int, deterministic: bool) -> bool:
    """Whether the deterministic path sums head blocks in pairs (one partial row per pair)."""
    return deterministic and n_hb % 2 == 0


def flags_per_chunk(n_tok: int, n_hb: int) -> int:
    """int32 zeros the kernel needs per launch: its ticket, the leaders' and the followers' counts."""
    return 1 + 2 * n_tok * n_hb


def _red(partial_rows: bool, lines, ablate: int, exact: bool = False) -> int:
    """``red_mode``, or in the fast mode with ``ablate`` 64 the packed-word prototype (4;
    5 with 128: unconverted), with 256 the fp32 lines of values rounded to a grid (6);
    ``exact``: the deterministic mode's exact two-word sums (7)."""
    if exact:
        return 7
    if ablate & 256 and not partial_rows:
        return 6
    if ablate & 64 and not partial_rows:
        return 5 if ablate & 128 else 4
    return red_mode(partial_rows, lines)


def red_mode(partial_rows: bool, lines: bool | None = None) -> int:
    """The kernel's RED constexpr: 0 partial rows (deterministic); fast mode: 1 half-line
    reductions, 2 whole lines."""
    if partial_rows:
        return 0
    if not (RED_LINES if lines is None else lines):
        return 1
    return 2


def options_summary() -> str:
    """The fast backward's schedule options this Triton runs by default, and whether they are
    all of those measured fastest (on under the Tritons they were timed with, 3.6, 3.8 and
    3.9; off under another until timed with it:
    docs/performance/backward.md#defaults-by-triton-version-measured)."""
    opts = [("split roles", SPLIT_ROLES == 2), ("dQ by TMA", bool(DQ_TMA)),
            ("q and dO by TMA at K <= 256", QD_TMA_MAX_K >= 256),
            ("transposed tiles at H <= 32", SMALL_H_TRANSPOSED and SPLIT_ROLES > 0)]
    text = ", ".join(f"{name} {'on' if on else 'off'}" for name, on in opts)
    if all(on for _, on in opts):
        return f"{text} (all of the options measured fastest)"
    return (f"{text} (off: not timed under this Triton; all on under 3.6, 3.8 and 3.9: "
            "docs/performance/backward.md#defaults-by-triton-version-measured)")


def exact_sums_ok(W: int, D: int) -> bool:
    """Whether ``launch`` (``exact_codes``) adds exact two-word sums for q width W and D
    value columns: at D = 512 without score-only columns (the lo words' offset,
    ``hopper.EXACT_LO_BYTES``)."""
    return W == D == 512


LAUNCH_CACHE = True  # ``launch`` takes ``cache``
DEFERS_DQ_PARTS = True  # ``launch`` takes ``dq_parts``
IN_ORDER = True  # ``launch`` takes ``in_order``
# With lengths in token order the remainder's parts run in a launch after the whole rounds'
# (``launch(in_order=True)``); True: that launch starts on each SM as the whole rounds'
# program there ends (programmatic dependent launch: the first launch signals at its start,
# the second waits for it only at its end, so the launches after both see both), as the
# parts do in a single launch. False: it starts once the last of them has ended
# (H100: the option cost 1.9-3.2% where every slot is valid that way, 0.8-1.2% with this,
# docs/performance/backward.md#the-remainders-launch-started-early-pdl).
REMAINDER_PDL = True


def launch(q, kv, indices, grad_out, lse, delta, grad_q, acc, partial, flags, t_begin, n_tok, scale,
           scale_log2, paired, topk_length=None, tokens=None, lines=None, order=None, evict_last=None,
           split=None, qd_tma=None, qd_early=None, dq_tma=None, ablate=0, trace=None, head_pad=None,
           transposed=None, cache=None, split_remainder=None, pairs_code=None, dq_parts=None,
           exact_codes=None, partial_exp=None, in_order=False, programs=None, pdl=None, ranks=None,
           fold=None, fold_tile=None, chain=None, _pdl=0):
    """One chunk of tokens [t_begin, t_begin + n_tok). ``acc``: the fake-ordered fp32
    [N, D] accumulator of the fast mode (``partial`` None), or ``partial``: the
    [n_tok, n_hb // (1 + paired), partial_slots(K), D] fp32 rows of the deterministic one.
    ``flags``: ``flags_per_chunk`` int32 zeros. ``topk_length``: int32 [T] or None; a
    tile visits the 64-slot blocks that hold its token's slots. With it the chunk holds the
    tokens ``tokens`` (int32 [n_tok], its partial rows in that order; default those of
    [t_begin, t_begin + n_tok)), taken in ``order`` (this chunk's part of ``schedule``;
    computed here when None; it holds the tokens, so ``tokens`` is then not read).
    ``ablate`` (measurement only; the gradients are then wrong): parts of a tile's work taken out,
    a sum of 1 (dQ stores), 2 (q/dO loads after a program's first tile, cp.async path),
    4 (lse/Delta loads: 0) and 8 (dKV reductions, or 16-bit partial rows' stores, predicated
    off); 512, 16-bit partial rows' stores left out of the build; 1024 with 8, those rows
    predicated off and not scaled (``_store_16_ablated``); 64, the fast mode's
    reductions as two s32 words a 64-bit add (``hopper.red_s32x2_lines``: the cost of an
    exact sum, docs/performance/backward.md#open-leads; grad_kv is then s32 words), with 128
    the fp32 bits sent unconverted (the conversion's cost apart); 256, the fast mode's
    reductions with each value rounded to a grid first (``hopper.red_f32x4_lines_grid``:
    the cost of exact fp32 sums on a per-row grid)
    (benchmarks/experiments/tile_ablation_bench.py). ``trace`` (measurement only): an int64
    tensor of ``trace_shape(n_tok, H, device, paired)`` that takes each tile's timeline, the
    SM's cycle counter at the events of ``TRACE_EVENTS`` (benchmarks/experiments/tile_timeline.py;
    ``ablate`` 32 with it: the global timer in ns instead, benchmarks/experiments/clock_bench.py).
    ``head_pad``: the heads the dKV products contract over (16, 32 or 64; ``_head_pad``).
    ``pairs_code``: whether a launch without head-block pairs keeps their code
    (``_pairs_code``).
    ``cache``: a dict kept over the chunks of one call (empty at the first): the launch's
    TMA descriptors and rope scratch are made once a call, not once a chunk (host time: a
    call at K = 2048 is 32 chunks).
    ``dq_parts``: None, or a list to which the launch appends the remainder tiles' dQ parts
    (``backward.DqParts``) for the caller's epilogue to sum, instead of summing them in a
    launch of its own.
    ``exact_codes``: int32 [N] (``exact_sums.row_codes``), the deterministic mode's exact
    two-word sums into ``acc`` [N, 2 D] (``partial`` None; D = 512, ``exact_sums_ok``).
    ``partial_exp`` (``backward.sparse_mla_bwd(partial16=...)``): ``partial``
    is fp16 and this holds its rows' scales (int64 [n_tok, n_hb, partial_slots(K),
    common.scale_words(D, rope)]: a biased exponent byte a segment); D = d_v = 512 or the
    576/512 layout (its score-only columns two segments of 32, one a consumer); ``paired``
    false (16-bit rows take no head-block pairs). With ``partial`` bf16 (D = d_v = 512, a
    measurement option: ``backward.PARTIAL_16_BF16``) the rows are stored unscaled and
    ``partial_exp`` is left as it is.
    ``in_order`` (with ``topk_length``, no ``tokens`` or ``order``): the tiles take the
    tokens in their order, not the lengths' balanced order (no ``schedule``; for lengths
    that follow the token order, as a causal indexer's trailing masked slots do). Such
    lengths only skip blocks: the ids past them must be masked, since the tiles past the
    last whole round of programs ignore them, cut into parts (``split_remainder``) in a
    launch of their own. ``programs``: the launch's program count (default one an SM, at
    most a tile each: ``program_count``). ``pdl``: whether that launch of the remainder's parts
    starts on the SMs the whole rounds' programs leave as they end, by programmatic
    dependent launch (default ``REMAINDER_PDL``); without it the parts start once the last
    whole-round program has ended (a single launch has no such wait).
    ``ranks`` (``backward.FOLD_IN_MAIN``): int32, flat [chunk x K]: each (token, slot) entry's rank
    in the chunk's sorted order plus one; ``partial`` (fp16, [(chunk x K + 1) x n_hb, 512])
    and ``partial_exp`` (int64, one word a row) then take entry e's head-block part p at row
    (e + 1) x n_hb + p (row p: slots past K). ``fold``: with ``ranks``, the previous chunk's
    (partial, partial_exp, sorted ids, segments), folded into ``acc`` by the producer
    (``fold_gluon``; D = d_v = 512, no lengths in token order). ``fold_tile``: (entries a
    tile, tiles in the ring, tiles after each slot block, tiles prefetched into the L2 ahead),
    default ``FOLD_TILE_ENTRIES``, ``FOLD_STAGES``, ``FOLD_TILES_A_BLOCK``, ``FOLD_L2_AHEAD``.
    ``chain`` (with ``ranks``; ``backward.FOLD_CHAIN``): (sync, c, need_t, need_f2, need_f3,
    early): the launches of a call's chunks overlap (each starts the next as its programs
    start, and with ``early`` a launch takes that start, by programmatic dependent launch;
    each ends after the one before it), and int32 counters
    ``sync`` (zeros; chunk k's at 2 (k + 3) and 2 (k + 3) + 1) order them: this chunk, c, counts
    its programs' stores, each once its tiles are done (two a program, one a consumer), and
    their ends of chunk c - 1's fold; its fold waits for need_t such counts of chunk c - 1 and
    need_f2 ends of chunk c - 2's fold, its stores for need_f3 ends of chunk c - 3's (whose
    rows this chunk's buffer held: three buffers)."""
    T, H, D = q.shape
    N, K = kv.shape[0], indices.shape[1]
    n_hb = triton.cdiv(H, BLOCK_H)
    exact = exact_codes is not None
    if exact and (partial is not None or not exact_sums_ok(D, grad_out.shape[-1])):
        raise ValueError(f"exact_codes: sums into the accumulator (no partial rows) at D = d_v = 512, "
                         f"got D = {D}, d_v = {grad_out.shape[-1]}")
    n_tiles = n_tok * n_hb
    if partial_exp is not None and (partial is None or grad_out.shape[-1] != 512
                                    or not (partial.dtype == torch.float16 and D in (512, 576)
                                            or partial.dtype == torch.bfloat16 and D == 512)):
        raise ValueError("16-bit partial rows: fp16 rows at D = d_v = 512 or the 576/512 layout, "
                         "bf16 rows at D = d_v = 512")
    if partial is not None and partial.dtype != torch.float32 and partial_exp is None:
        raise ValueError(f"partial rows: fp32, or 16-bit with their scale words (partial_exp); "
                         f"got {partial.dtype}")
    if paired and (partial is None or n_hb % 2):
        raise ValueError("head blocks pair up only on the partial-row path, with an even count")
    grid = program_count(n_tiles, q.device, paired) if programs is None else int(programs)
    in_order = bool(in_order) and topk_length is not None
    if in_order and (tokens is not None or order is not None):
        raise ValueError("in_order: the chunk's tokens in their order (no tokens or order given)")
    cut = SPLIT_REMAINDER if split_remainder is None else split_remainder
    rope = D - grad_out.shape[-1]
    nb = triton.cdiv(K, BLOCK_K)
    if topk_length is not None and order is None and not in_order:
        if tokens is None:
            tokens = torch.arange(t_begin, t_begin + n_tok, device=q.device, dtype=torch.int32)
        order = schedule(topk_length, n_tok, H, paired, tokens)
    cache = {} if cache is None else cache
    # the programs' dQ scratch for the rope columns (zeros; the kernel leaves it zero, so the
    # chunks of a call share it: the first chunk has the most programs)
    dqr = cache.get("dqr") if rope else acc
    if rope and (dqr is None or dqr.shape[0] < grid):
        dqr = cache["dqr"] = torch.zeros((grid, BLOCK_H, rope), dtype=torch.float32, device=q.device)
    sp = _split(partial is not None, split, n_hb, K) if rope == 0 else 0
    if partial_exp is not None and split is None:
        # (the split 1 build with 16-bit stores spills 944 bytes and serialises its wgmmas,
        # Triton 3.6; the unsplit one reloads nothing in its block loops, and split 1 gained
        # the fp32 rows 1.6-3%)
        sp = 0
    tma, early = _qd_loads(q, grad_out, rope, sp, K, qd_tma, qd_early)
    dq_want = int((DQ_TMA_ROPE if rope else DQ_TMA) if dq_tma is None else dq_tma)
    if dq_want not in (0, 1):
        raise ValueError(f"dq_tma: 0 (plain stores) or 1 (staged in q's quarters, stored by TMA), "
                         f"got {dq_want}")
    dq_by_tma = dq_want if _tma_ok(grad_q) else 0
    if dq_by_tma:
        early = 0
    hp = _head_pad(H, head_pad)
    trans = _transposed(hp, sp, rope, partial is not None, transposed)
    if trans:
        early = 0
        if in_order:  # (this build with HAS_LEN 2 reloads a value a block loop, sm_90, Triton
            # 3.6: the given lengths' build, with the tokens' own order as its schedule)
            pos = torch.arange(n_tok, device=q.device, dtype=torch.int32)
            order, in_order = torch.stack((pos, pos + t_begin), 1), False
    sorted_rows = ranks is not None
    if sorted_rows:
        if (partial is None or partial.dtype != torch.float16 or partial_exp is None or rope or paired or sp
                or trans or in_order or trace is not None or ablate or exact):
            raise ValueError("partial rows at their ranks: 16-bit rows at D = d_v = 512, unpaired, "
                             "unsplit, without in_order, trace or ablate")
        tma = False  # (the sorted builds' producers load q and dO by cp.async)
        early = 0
    if fold is not None and not sorted_rows:
        raise ValueError("the fold in the main kernel: with partial rows at their ranks (ranks)")
    if chain is not None:
        if not sorted_rows:
            raise ValueError("chained launches: with partial rows at their ranks (ranks)")
        sync, chain_c, need_t, need_f2, need_f3, early_start = chain
        if sync.dtype != torch.int32:
            raise ValueError(f"chain: int32 counters, got {sync.dtype}")
        _pdl = 3
    else:  # (an fp32 tensor as ``sync``: its dtype tells the kernel, CHAIN)
        sync, chain_c, need_t, need_f2, need_f3, early_start = acc, 0, 0, 0, 0, False
    if "args" not in cache:  # (the same tensors and settings for every chunk of a call)
        cache["args"] = ((_qd_descriptor(q), _qd_descriptor(grad_out)) if tma else (q, grad_out),
                         _qd_descriptor(grad_q) if dq_by_tma else grad_q)
    (q_arg, do_arg), dq_arg = cache["args"]
    if trace is not None:
        want = trace_shape(n_tok, H, q.device, paired)
        if tuple(trace.shape) != want or trace.dtype != torch.int64:
            raise ValueError(f"trace: int64 {want}, got {trace.dtype} {tuple(trace.shape)}")
        ablate = int(ablate) | 16
    parts_ok = cut and partial is None and rope == 0 and not trans
    if in_order and parts_ok and not exact and trace is None and programs is None:
        # The lengths' build has no parts (with them its split schedules reload values in
        # the block loop): the whole rounds take the lengths, the remainder's tiles then
        # run without them, cut into parts, on every program (ids past a length are masked).
        n_full, n_parts = _remainder_parts(n_tiles, grid, nb, True)
        if n_parts > 1 and n_full % n_hb == 0:
            common = dict(lines=lines, evict_last=evict_last, split=split, qd_tma=qd_tma, qd_early=qd_early,
                          dq_tma=dq_tma, ablate=ablate, head_pad=head_pad, transposed=transposed, cache=cache,
                          pairs_code=pairs_code, dq_parts=dq_parts)
            n_whole = n_full // n_hb
            early = REMAINDER_PDL if pdl is None else bool(pdl)
            launch(q, kv, indices, grad_out, lse, delta, grad_q, acc, None, flags, t_begin, n_whole, scale,
                   scale_log2, paired, topk_length=topk_length, in_order=True, _pdl=int(early), **common)
            # (a ticket of its own: the fast mode's flags past the first are not read)
            launch(q, kv, indices, grad_out, lse, delta, grad_q, acc, None, flags[1:], t_begin + n_whole,
                   n_tok - n_whole, scale, scale_log2, paired, split_remainder=True, programs=grid,
                   _pdl=2 if early else 0, **common)
            return
    n_full, n_parts = _remainder_parts(n_tiles, grid, nb, parts_ok and topk_length is None)
    n_units = n_full + (n_tiles - n_full) * n_parts
    fe, fs, ft, fa = (fold_tile if fold_tile is not None
                      else (FOLD_TILE_ENTRIES, FOLD_STAGES, FOLD_TILES_A_BLOCK, FOLD_L2_AHEAD))
    if fold is not None and n_hb not in (1, 2):
        raise ValueError(f"the fold in the main kernel: one or two head blocks (H <= 128), got H = {H}")
    fe = max(1, fe // n_hb)  # (a tile's rows: the entries' parts, the same bytes at any H)
    fp, fexp, fsid, fseg = fold if fold is not None else (flags, flags, flags, flags)
    dqf = (torch.empty((n_units - n_full, BLOCK_H, D), dtype=torch.float32, device=q.device)
           if n_units > n_full else acc)
    _bwd_main_gluon_kernel[(grid,)](
        q_arg, kv, indices, do_arg, lse, delta, dq_arg, acc,
        partial if partial is not None else exact_codes if exact else acc, flags,
        topk_length if topk_length is not None else indices, order if order is not None else indices, dqr,
        trace if trace is not None else flags, grad_q, dqf,
        partial_exp if partial_exp is not None else flags,
        ranks if sorted_rows else flags, fsid, fseg, fp, fexp, sync,
        H, N, K, t_begin, n_tiles, int(paired), n_units, n_full, n_parts, int(ft), int(fa),
        int(chain_c) + 3, int(need_t), int(need_f2), int(need_f3),
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), grad_out.stride(0),
        grad_out.stride(1), lse.stride(0), grad_q.stride(0), grad_q.stride(1),
        scale, scale_log2,
        D=grad_out.shape[-1], HAS_LEN=2 if in_order else topk_length is not None,
        RED=_red(partial is not None, lines, ablate, exact),
        EVICT_LAST=_evict_last(N, D, q.device, evict_last) and partial is None and not exact,
        ROPE=rope, SPLIT=sp, QD_TMA=bool(tma), QD_EARLY=early, DQ_TMA=dq_by_tma, ABL=int(ablate),
        HP=hp, TRANS=trans, PARTS=n_units > n_full,
        PAIRS=_pairs_code(paired, partial is not None, rope, pairs_code,
                          rows16=partial_exp is not None and bool(dq_by_tma)),
        PDL=_pdl, SORTED=int(sorted_rows),
        FOLD_E=int(fe) if fold is not None else 0, FOLD_S=int(fs),
        FOLD_NP=n_hb, num_warps=NUM_WARPS, maxnreg=MAXNREG,
        **({"launch_pdl": True} if _pdl == 2 or _pdl == 3 and early_start else {}),
    )
    if n_units > n_full:  # the remainder tiles' dQ: their parts summed in order
        job = DqParts(dqf, grad_q, t_begin, n_full, n_parts, n_tiles - n_full, n_hb, BLOCK_H)
        if dq_parts is None:
            sum_dq_parts(job)
        else:  # (the caller's epilogue launch sums them)
            dq_parts.append(job)


def _remainder_parts(n_tiles: int, grid: int, nb: int, allowed: bool) -> tuple[int, int]:
    """(tiles taken whole, parts a remainder tile is cut into): the tiles past the last whole
    round of ``grid`` programs are cut by slot blocks into parts, one a program, so that the
    programs of that round end together (a static round robin otherwise leaves
    ``grid - n_tiles % grid`` programs idle for about a tile:
    docs/performance/backward.md#the-clock-and-the-last-round-measured)."""
    r = n_tiles % grid  # (every tile when a launch of fewer tiles has more programs)
    if not allowed or r == 0 or nb < 2 or grid // r < 2:
        return n_tiles, 1
    per = triton.cdiv(nb, min(nb, grid // r))  # slot blocks a part
    return n_tiles - r, triton.cdiv(nb, per)


def trace_shape(n_tok: int, H: int, device, paired: bool) -> tuple[int, int, int]:
    """``launch(trace=...)``'s shape: [programs, tiles a program, events]."""
    n_tiles = n_tok * triton.cdiv(H, BLOCK_H)
    grid = program_count(n_tiles, device, paired)
    return (grid, triton.cdiv(n_tiles, grid), len(TRACE_EVENTS))


def _qd_loads(q, grad_out, rope: int, split: int, K: int, qd_tma=None, qd_early=None) -> tuple[bool, int]:
    """How the producer loads q and dO: (by TMA, quarters released early). TMA where it can
    address both (``_tma_ok``) at D = 512, by default at K <= ``QD_TMA_MAX_K``; the early
    release with TMA and a split schedule."""
    want = QD_TMA if qd_tma is None else qd_tma
    if want is None:
        want = K <= QD_TMA_MAX_K
    tma = bool(want) and rope == 0 and _tma_ok(q) and _tma_ok(grad_out)
    early = int(QD_EARLY if qd_early is None else qd_early)
    if early not in (0, 2, 3):
        raise ValueError(f"qd_early: 0 (off), 2 or 3 quarters, got {early}")
    return tma, early if tma and split else 0


def _tma_ok(x) -> bool:
    """Whether TMA can load [1, 64, 128] tiles of ``x`` ([T, H, D]): the last dim
    contiguous, the base and the other strides 16-byte aligned and not 0 (an expanded
    gradient: the driver's tensor map is not documented for a zero stride; cp.async then)."""
    return (x.stride(2) == 1 and x.data_ptr() % 16 == 0
            and all(x.stride(i) > 0 and (x.stride(i) * x.element_size()) % 16 == 0 for i in (0, 1)))


def _qd_descriptor(x):
    layout = gl.NVMMASharedLayout.get_default_for([1, BLOCK_H, 128], _GL_DTYPES[x.dtype])
    return TensorDescriptor(x, list(x.shape), [x.stride(0), x.stride(1), 1], [1, BLOCK_H, 128], layout)


def _head_pad(H: int, head_pad=None) -> int:
    """The heads a tile's dKV products contract over (the kernel's ``HP``): the fewest of
    16, 32 and 64 that hold H (P's and dS's rows past H are zeros), 64 with several head
    blocks; ``head_pad`` (16, 32 or 64, at least that) overrides it for A/B runs."""
    need = 16 if H <= 16 else 32 if H <= 32 else BLOCK_H
    if head_pad is None:
        return need if HEAD_PAD else BLOCK_H
    if head_pad not in (16, 32, BLOCK_H) or head_pad < need:
        raise ValueError(f"head_pad: 16, 32 or 64 and at least the tile's heads ({need}), got {head_pad}")
    return int(head_pad)


def _transposed(hp: int, split: int, rope: int, deterministic: bool, transposed=None) -> bool:
    """Whether a launch runs the transposed small-head tiles (``_consume_tile_split_t``): the
    fast mode's split schedules at D = 512 where the tile's heads fit 16 or 32 (``hp``), if
    ``transposed`` (default ``SMALL_H_TRANSPOSED``) asks for them."""
    want = SMALL_H_TRANSPOSED if transposed is None else transposed
    return bool(want) and hp < BLOCK_H and split > 0 and rope == 0 and not deterministic


def _split(deterministic: bool, split, n_hb: int = 1, K: int = 0) -> int:
    """The schedule of a launch (``SPLIT``): ``split`` if given, else this Triton's default
    for the mode, the head blocks ``n_hb`` and the slots ``K``."""
    if split is None:
        if not deterministic:
            split = SPLIT_ROLES
        elif n_hb == 1 and K >= SPLIT_DET_MIN_K:
            split = SPLIT_ROLES_DET_ONE_HB
        else:
            split = SPLIT_ROLES_DET
    return int(split)


def _pairs_code(paired: bool, deterministic: bool, rope: int = 0, pairs_code=None,
                rows16: bool = False) -> bool:
    """The kernel's ``PAIRS``: whether its build holds the head-block pairs' code. A paired
    launch needs it (the deterministic mode at two head blocks); under Triton 3.9 every
    other build leaves it out (before ``hopper.fresh`` that took the fast mode's block-loop
    reloads from 50-51 to 5-6 and the deterministic mode's at one head block from 9-16 to
    3, and the latter 5.3% of its time at H64 K640:
    docs/performance/backward.md#defaults-by-triton-version-static).
    Not the deterministic 576/512 build, which without it serialises its wgmmas under 3.9,
    nor under 3.6-3.8, whose builds stay as measured (with the pairs' flags runtime zeros;
    under 3.6 leaving them out shortens the fp32 rows' loops with no reload, but was timed
    within 0.5%, and with 16-bit rows at 64 heads a tile it serialises the wgmmas: +22% at
    H64 K640, H100). Nor the 576/512 build
    with 16-bit rows and dQ by TMA (``rows16``; such rows never pair): with the code its
    block loops reload a value each (Triton 3.6), without it none (with dQ's plain stores,
    without it the wgmmas serialise). ``pairs_code`` (default ``PAIRS_CODE``)
    overrides it where the launch has no pairs."""
    if paired:
        return True
    want = PAIRS_CODE if pairs_code is None else pairs_code
    if want is not None:
        return bool(want)
    if rows16 and rope:
        return False
    return not (_TRITON_39 and (rope == 0 or not deterministic))


def _evict_last(N: int, D: int, device, evict_last) -> bool:
    """Whether the fast mode's reductions carry the L2 evict-last policy: ``evict_last``, or
    by default where the fp32 accumulator is EVICT_LAST_MIN_L2 times the L2 or more."""
    if evict_last is not None:
        return bool(evict_last)
    l2 = getattr(cuda_properties(device), "L2_cache_size", 0) if device.type == "cuda" else 0
    return l2 > 0 and N * D * 4 >= EVICT_LAST_MIN_L2 * l2


def program_count(n_tiles: int, device, paired: bool) -> int:
    """A persistent launch's programs: one an SM, at most one a tile, an even count where
    head blocks pair."""
    grid = min(n_tiles, cuda_properties(device).multi_processor_count)
    if paired:  # an even program count keeps both tiles of a pair in the same round
        grid -= grid % 2
    return grid


def schedule(topk_length, chunk: int, H: int, paired: bool, tokens=None):
    """With lengths the tiles differ in work: int32 [P, 2], for each chunk of ``chunk``
    positions of ``tokens`` (int32 [P]: position p holds token tokens[p]; default: token p
    of topk_length's), the (position, token) pairs in the order in which the chunk's
    programs take them (``hopper.balanced_order`` of the positions' lengths), for all
    chunks of a call at once."""
    n_hb = triton.cdiv(H, BLOCK_H)
    if tokens is None:
        tokens = torch.arange(topk_length.shape[0], device=topk_length.device, dtype=torch.int32)
    P = tokens.shape[0]
    lengths = topk_length.index_select(0, tokens)
    order = balanced_order(lengths, chunk, program_count(chunk * n_hb, topk_length.device, paired), n_hb)
    first = torch.arange(P, device=tokens.device, dtype=torch.int32) // chunk * chunk  # the chunk's first
    return torch.stack((order, tokens.index_select(0, first + order)), 1)


def tile_heads(D: int, H: int) -> int:
    return BLOCK_H
