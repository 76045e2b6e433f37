"""A frozen copy of the Gluon backward main kernel (as of 2a6a5c9) with one switch, MODE,
for how the dKV rows leave the kernel. Benchmark-side only: the shipped kernel is
src/dsv4_sparse_attn/kernels/backward_gluon.py. Driven by dkv_modes_bench.py; the results
are in docs/performance/backward.md#dkv-accumulation-modes.

MODE 0: per-(token, slot) partial rows (the deterministic path as shipped then);
1: fp32 atomics as Triton emits them (8-byte reductions);
2: 16-byte fp32 reductions in fake column order (what the fast mode ships now);
3: int64 fixed-point reductions (exact, order-independent: a deterministic candidate);
4: mode 2 with the reductions predicated off at run time (what the reductions cost).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy as cp,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dsv4_sparse_attn.kernels.common import cuda_properties
from dsv4_sparse_attn.kernels.hopper import load_ids as _load_ids

_MAIN_RUNTIME_INTS = ["T", "H", "N", "K", "t_begin", "stride_it", "stride_lt"]

__all__ = ["launch_main"]

NUM_WARPS = 4  # per partition; the kernel runs 3 partitions (12 warps)
MAXNREG = 168  # 12 warps x 32 threads x 168 registers fit the 64K register file

# mbarrier slots
_QD_READY = gl.constexpr(0)
_QD_FREE = gl.constexpr(1)
_KV_READY = gl.constexpr(2)  # + D half
_KV_FREE = gl.constexpr(4)  # + D half
_PDS_READY = gl.constexpr(6)
_PDS_FREE = gl.constexpr(7)
_N_BARS = gl.constexpr(8)
# How many slot blocks a pair's leader may run ahead of its follower's adds (see
# _consume_tile). H200, T=4096, H=128: 0 (lockstep) -8.8% backward time against no pacing
# at K=1152 and K=512, 1 -7.5%, 2 -4%, 4 -1% (docs/performance/backward.md). Must be >= 0.
_LAG = gl.constexpr(0)
_BH = gl.constexpr(64)  # heads of a tile
_BK = gl.constexpr(64)  # slots of a block
_QD = gl.constexpr(128)  # D quarter: D = 512 only


@gluon.jit
def _producer(Q, DO, KV, IDX, H, N, K, t_begin, n_tiles, stride_qt, stride_qh, stride_dt, stride_dh,
              stride_kvn, stride_it, q_smem, do_smem, kv_smem, bars, nb, rank):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # 16-byte copies
    offs_d = gl.arange(0, _QD, layout=gl.SliceLayout(0, ld))
    offs_r = gl.arange(0, _BK, layout=gl.SliceLayout(1, ld))
    n_hb = gl.cdiv(H, _BH)
    tcount = 0
    for tile in range(rank, n_tiles, gl.num_programs(0)):
        pid_t = t_begin + (tile // n_hb).to(gl.int64)
        pid_h = tile % n_hb
        # q and dO of this tile, once both consumers are done with the previous tile's
        # (a fresh mbarrier counts its phase "1" as complete: the first wait passes).
        mbarrier.wait(bars.index(_QD_FREE), (tcount & 1) ^ 1)
        h = pid_h * _BH + offs_r  # _BH == _BK: the row offsets serve both
        h_ok = (h < H)[:, None]
        h64 = h[:, None].to(gl.int64)
        q_ptrs = Q + pid_t * stride_qt + h64 * stride_qh + offs_d[None, :]
        do_ptrs = DO + pid_t * stride_dt + h64 * stride_dh + offs_d[None, :]
        if True:
            for c in gl.static_range(4):
                cp.async_copy_global_to_shared(q_smem.index(c), q_ptrs + c * _QD, mask=h_ok)
                cp.async_copy_global_to_shared(do_smem.index(c), do_ptrs + c * _QD, mask=h_ok)
        cp.mbarrier_arrive(bars.index(_QD_READY), increment_count=False)

        idx_row = IDX + pid_t * stride_it
        ids = _load_ids(idx_row, 0, K, offs_r)
        g0 = tcount * nb
        for j in range(0, nb):
            free_phase = ((g0 + j) & 1) ^ 1
            ids64 = ids.to(gl.int64)
            valid = (ids64 >= 0) & (ids64 < N)
            rows = gl.where(valid, ids64, 0)  # masked ids never form an address (zero rows)
            ptrs = KV + rows[:, None] * stride_kvn + offs_d[None, :]
            vm = valid[:, None]
            ids = _load_ids(idx_row, (j + 1) * _BK, K, offs_r)  # next block's ids, ahead
            for half in gl.static_range(2):
                mbarrier.wait(bars.index(_KV_FREE + half), free_phase)
                if True:
                    cp.async_copy_global_to_shared(kv_smem.index(2 * half), ptrs + (2 * half) * _QD, mask=vm)
                    cp.async_copy_global_to_shared(kv_smem.index(2 * half + 1), ptrs + (2 * half + 1) * _QD,
                                                   mask=vm)
                cp.mbarrier_arrive(bars.index(_KV_READY + half), increment_count=False)
        tcount += 1


@gluon.jit
def _consumer(args, WG: gl.constexpr, MODE: gl.constexpr):
    (IDX, LSE, DELTA, DQ, DKV, PARTIAL, H, N, K, t_begin, n_tiles, stride_it, stride_lt, stride_gt,
     stride_gh, scale, scale_log2, i64_scale, q_smem, do_smem, kv_smem, p_smem, ds_smem, bars, nb, FLAGS,
     rank, paired) = args
    n_hb = gl.cdiv(H, _BH)
    tcount = 0
    for tile in range(rank, n_tiles, gl.num_programs(0)):
        pid_c = (tile // n_hb).to(gl.int64)  # token within the chunk
        pid_h = tile % n_hb
        _consume_tile(IDX, LSE, DELTA, DQ, DKV, PARTIAL, H, N, K, stride_it, stride_lt, stride_gt, stride_gh,
                      scale, scale_log2, i64_scale, q_smem, do_smem, kv_smem, p_smem, ds_smem, bars, nb,
                      pid_c, t_begin + pid_c, pid_h, n_hb, tcount, FLAGS, paired, n_tiles, rank, WG, MODE)
        tcount += 1


@gluon.jit
def _dkv_piece(p_smem, ds_smem, do_smem, q_smem, quarter, hh: gl.constexpr, zero):
    """Columns [hh*64, hh*64+64) of D quarter ``quarter`` of a block's dKV rows, issued
    asynchronously: P^T dO + dS^T Q (M = 64 slots, N = 64, K = 64 heads)."""
    acc = warpgroup_mma(p_smem.permute((1, 0)), do_smem.index(quarter).slice(hh * 64, 64, dim=1), zero,
                        use_acc=False, is_async=True)
    return warpgroup_mma(ds_smem.permute((1, 0)), q_smem.index(quarter).slice(hh * 64, 64, dim=1), acc,
                         is_async=True)


@gluon.jit
def _group_base(row_ptr, offs_d, WORDS: gl.constexpr):
    """[slot, column] -> the address of the column's 16-column group in the slot's row, as
    an int64 (a thread holds 2 rows x 4 groups of a 64-column piece: 8 distinct values)."""
    return (row_ptr[:, None] + (offs_d[None, :] // 16) * (16 * WORDS)).to(gl.int64)


@gluon.jit
def _red_f32x4(base, acc, on):
    """Add a 64-column piece (wgmma layout) into fp32 rows stored in fake column order:
    column 16g + 8h + 2l + b of a row lands at 16g + 4l + 2h + b, so the four values a
    thread holds of one row in a group are adjacent and one 16-byte reduction adds them.
    pack=8 gives an asm instance a thread's registers i..i+7: (r,c) (r,c+1) (r+8,c)
    (r+8,c+1) (r,c+8) (r,c+9) (r+8,c+8) (r+8,c+9), c = 16g + 2l, l = lane % 4.
    $0-$7: dummy outputs; $8-$15: group bases; $16-$23: values; $24-$31: ``on`` (0 skips)."""
    return gl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .b32 l;
        .reg .b64 o, o8;
        setp.ne.b32 p, $24, 0;
        mov.u32 l, %laneid;
        and.b32 l, l, 3;
        mul.wide.u32 o, l, 16;
        add.s64 o8, o, $10;
        add.s64 o, o, $8;
        @p red.relaxed.gpu.global.add.v4.f32 [o], {$16, $17, $20, $21};
        @p red.relaxed.gpu.global.add.v4.f32 [o8], {$18, $19, $22, $23};
        mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
        mov.b32 $4, 0; mov.b32 $5, 0; mov.b32 $6, 0; mov.b32 $7, 0;
        }""",
        "=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,l,l,l,l,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        [base, acc, on], dtype=gl.int32, is_pure=False, pack=8)


@gluon.jit
def _red_i64(base, acc, scale):
    """Add a 64-column piece into int64 fixed-point rows (natural column order): each value
    times ``scale`` (a power of 2), rounded to an integer, added with an integer reduction,
    which is exact and so independent of the order the adds arrive in.
    $8-$15: group bases (int64 rows); $16-$23: values; $24-$31: scale."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 l;
        .reg .pred p;
        .reg .b64 o, o8, v<8>;
        .reg .f32 x<8>;
        setp.ne.f32 p, $24, 0f00000000;
        mov.u32 l, %laneid;
        and.b32 l, l, 3;
        mul.wide.u32 o, l, 16;
        add.s64 o8, o, $10;
        add.s64 o, o, $8;
        mul.f32 x0, $16, $24; cvt.rni.s64.f32 v0, x0;
        mul.f32 x1, $17, $25; cvt.rni.s64.f32 v1, x1;
        mul.f32 x2, $18, $26; cvt.rni.s64.f32 v2, x2;
        mul.f32 x3, $19, $27; cvt.rni.s64.f32 v3, x3;
        mul.f32 x4, $20, $28; cvt.rni.s64.f32 v4, x4;
        mul.f32 x5, $21, $29; cvt.rni.s64.f32 v5, x5;
        mul.f32 x6, $22, $30; cvt.rni.s64.f32 v6, x6;
        mul.f32 x7, $23, $31; cvt.rni.s64.f32 v7, x7;
        @p red.relaxed.gpu.global.add.u64 [o], v0;
        @p red.relaxed.gpu.global.add.u64 [o+8], v1;
        @p red.relaxed.gpu.global.add.u64 [o8], v2;
        @p red.relaxed.gpu.global.add.u64 [o8+8], v3;
        @p red.relaxed.gpu.global.add.u64 [o+64], v4;
        @p red.relaxed.gpu.global.add.u64 [o+72], v5;
        @p red.relaxed.gpu.global.add.u64 [o8+64], v6;
        @p red.relaxed.gpu.global.add.u64 [o8+72], v7;
        mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
        mov.b32 $4, 0; mov.b32 $5, 0; mov.b32 $6, 0; mov.b32 $7, 0;
        }""",
        "=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,l,l,l,l,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        [base, acc, scale], dtype=gl.int32, is_pure=False, pack=8)


@gluon.jit
def _store_piece(row_ptr, offs_d, acc, mask, follower, paired, i64_scale, on, MODE: gl.constexpr):
    """acc[slot, c] to row_ptr[slot] + c. MODE 0: partial rows; 1: fp32 atomics (Triton's
    8-byte reds); 2: 16-byte fp32 reductions in fake column order; 3: int64 fixed-point
    reductions; 4: mode 2 with every reduction predicated off (diagnostic)."""
    if MODE == 1:
        gl.atomic_add(row_ptr[:, None] + offs_d[None, :], acc, mask=mask, sem="relaxed")
    elif MODE == 2 or MODE == 4:
        _red_f32x4(_group_base(row_ptr, offs_d, 1), acc, gl.full(acc.shape, 1, gl.int32,
                                                                 acc.type.layout) * on)
    elif MODE == 3:
        _red_i64(_group_base(row_ptr, offs_d, 2), acc, gl.full(acc.shape, 1.0, gl.float32,
                                                               acc.type.layout) * i64_scale)
    else:
        ptrs = row_ptr[:, None] + offs_d[None, :]
        if follower:
            gl.atomic_add(ptrs, acc, sem="relaxed")
        elif paired:  # the follower adds to these rows shortly: keep them in L2
            gl.store(ptrs, acc)
        else:  # streaming: each partial row is read once, by the reduction (+5%)
            gl.store(ptrs, acc, cache_modifier=".cs")


@gluon.jit
def _consume_tile(IDX, LSE, DELTA, DQ, DKV, PARTIAL, H, N, K, stride_it, stride_lt, stride_gt, stride_gh,
                  scale, scale_log2, i64_scale, q_smem, do_smem, kv_smem, p_smem, ds_smem, bars, nb,
                  pid_c, pid_t, pid_h, n_hb, tcount, FLAGS, paired, n_tiles, rank, WG: gl.constexpr,
                  MODE: gl.constexpr):
    """One (token, 64-head block) tile of consumer ``WG`` (0 or 1)."""
    D: gl.constexpr = 4 * _QD
    dtype: gl.constexpr = q_smem.dtype
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, _BK, 16])
    dq_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, _QD, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, s_l)
    col_l: gl.constexpr = gl.SliceLayout(0, s_l)
    # A dKV piece is [_BK slots, 64 columns] with S's wgmma layout: each thread holds two
    # slot rows and pairs of adjacent columns (8-byte stores).
    dkv_k_l: gl.constexpr = gl.SliceLayout(1, s_l)
    dkv_d_l: gl.constexpr = gl.SliceLayout(0, s_l)

    h_row = pid_h * _BH + gl.arange(0, _BH, layout=row_l)
    h_ok = h_row < H
    lse = gl.load(LSE + pid_t * stride_lt + h_row, mask=h_ok, other=float("-inf"))
    # Rows with lse = -inf (no valid slot, no sink) and padding heads have P = 0.
    row_ok = h_ok & (lse > float("-inf"))
    lse2 = gl.where(row_ok, lse * 1.4426950408889634, 0.0)
    delta = gl.load(DELTA + pid_t * H + h_row, mask=h_ok, other=0.0)
    offs_c = gl.arange(0, _BK, layout=col_l)
    offs_dd = gl.arange(0, 64, layout=dkv_d_l)
    offs_ks = gl.arange(0, _BK, layout=dkv_k_l)
    idx_row = IDX + pid_t * stride_it
    s_zero = gl.zeros([_BH, _BK], gl.float32, layout=s_l)
    dq_zero = gl.zeros([_BH, _QD], gl.float32, layout=dq_l)
    dkv_zero = gl.zeros([_BK, 64], gl.float32, layout=s_l)
    dq0 = dq_zero
    dq1 = dq_zero
    g0 = tcount * nb
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
    follower = (paired != 0) & (pid_h % 2 == 1)
    leader = (paired != 0) & (pid_h % 2 == 0)
    n_part = n_hb // (1 + paired)
    part_h = pid_h // (1 + paired)
    flag_ptr = FLAGS + 1 + (pid_c * n_part + part_h) * 2 + WG
    done_ptr = flag_ptr + n_tiles  # the follower's count of added blocks
    pace = leader & (gl.atomic_add(FLAGS, 0, sem="relaxed", scope="gpu") > rank + 1)

    mbarrier.wait(bars.index(_QD_READY), tcount & 1)
    for j in range(0, nb):
        g = g0 + j
        ph = g & 1
        # z is 0 (grid z = 1) but unknown to the compiler: the shared-memory descriptors
        # (kv, q, dO, P, dS) are formed in the loop instead of hoisted out of it and
        # spilled. A spilled value's reload queues behind this warp group's dKV stores in
        # the L1 pipeline, so the next block would wait for the stores to drain (ncu: 53%
        # of stalls on L1TEX scoreboards; -8% backward time once P and dS got this too).
        z = j * gl.program_id(2)
        if g % 2 == WG:  # my block: S, dP, P and dS
            ids = _load_ids(idx_row, j * _BK, K, offs_c)
            mbarrier.wait(bars.index(_KV_READY + 0), ph)
            fence_async_shared()
            s = warpgroup_mma(q_smem.index(z), kv_smem.index(z).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            dp = warpgroup_mma(do_smem.index(z), kv_smem.index(z).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
            s = warpgroup_mma(q_smem.index(z + 1), kv_smem.index(z + 1).permute((1, 0)), s, is_async=True)
            dp = warpgroup_mma(do_smem.index(z + 1), kv_smem.index(z + 1).permute((1, 0)), dp, is_async=True)
            mbarrier.wait(bars.index(_KV_READY + 1), ph)
            fence_async_shared()
            s = warpgroup_mma(q_smem.index(z + 2), kv_smem.index(z + 2).permute((1, 0)), s, is_async=True)
            dp = warpgroup_mma(do_smem.index(z + 2), kv_smem.index(z + 2).permute((1, 0)), dp, is_async=True)
            s = warpgroup_mma(q_smem.index(z + 3), kv_smem.index(z + 3).permute((1, 0)), s, is_async=True)
            dp = warpgroup_mma(do_smem.index(z + 3), kv_smem.index(z + 3).permute((1, 0)), dp, is_async=True)
            s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
            valid = (ids >= 0) & (ids < N)
            p = gl.exp2(s * scale_log2 - lse2[:, None])
            p = gl.where(row_ok[:, None] & valid[None, :], p, 0.0)
            ds = p * (dp - delta[:, None]) * scale
            # Publish once both consumers are done with the previous block's P and dS.
            mbarrier.wait(bars.index(_PDS_FREE), ph ^ 1)
            p_smem.index(z).store(p.to(dtype))
            ds_smem.index(z).store(ds.to(dtype))
            fence_async_shared()
            mbarrier.arrive(bars.index(_PDS_READY))

        mbarrier.wait(bars.index(_PDS_READY), ph)
        # dQ[:, my half] += dS KV[:, my half] (scale is folded into dS).
        dq0 = warpgroup_mma(ds_smem.index(z), kv_smem.index(2 * WG + z), dq0, is_async=True)
        dq1 = warpgroup_mma(ds_smem.index(z), kv_smem.index(2 * WG + 1 + z), dq1, is_async=True)
        dq0, dq1 = warpgroup_mma_wait(num_outstanding=0, deps=(dq0, dq1))
        mbarrier.arrive(bars.index(_KV_FREE + WG))  # my kv half: the next block's gather may start

        # dKV rows of this block for my half of D, a quarter at a time: P^T dO + dS^T Q
        # (M = 64 slots, N = 128 columns, K = 64 heads; P and dS read transposed).
        # (offsets built from z stay in the loop: hoisted, they would spill)
        offs_kz = offs_ks + z
        if MODE != 0:
            ids_k = _load_ids(idx_row, j * _BK, K, offs_kz).to(gl.int64)
            valid_k = (ids_k >= 0) & (ids_k < N)
            if MODE == 3:
                row_ptr = DKV + gl.where(valid_k, ids_k, N) * (2 * D)  # int64 rows: 2 fp32 words each
            elif MODE == 2:
                row_ptr = DKV + gl.where(valid_k, ids_k, N) * D  # masked slots add to a spare row N
            else:
                row_ptr = DKV + gl.where(valid_k, ids_k, 0) * D  # [slot] row starts
            mask = valid_k[:, None]
            if MODE == 4:
                mask = (offs_kz < (pid_c < 0).to(gl.int32))[:, None]
        else:
            mask = (offs_kz < (pid_c < 0).to(gl.int32))[:, None]  # (unused)
            # (the buffer's slot dim is padded to whole blocks: stores need no mask)
            # (j ^ z == j, but not an induction variable: LLVM would otherwise strength-reduce
            # every store address into its own loop-carried pointer)
            row_ptr = PARTIAL + ((pid_c * n_part + part_h) * nb + (j ^ z)) * (_BK * D) + offs_kz * D
        if MODE == 4:  # (a run-time false: the compiler must keep the values the reductions take)
            on = (pid_c < 0).to(gl.int32)
        else:
            on = (pid_c >= 0).to(gl.int32)
        # Four 64-column pieces (32 registers each next to dQ's 128); each piece's stores
        # are issued while the next piece's wgmma runs.
        acc = _dkv_piece(p_smem.index(z), ds_smem.index(z), do_smem, q_smem, 2 * WG + z, 0, dkv_zero)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        nxt = _dkv_piece(p_smem.index(z), ds_smem.index(z), do_smem, q_smem, 2 * WG + z, 1, dkv_zero)
        if follower:  # the leader's rows of this block must be in place before I add to them
            while gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu") <= j:
                pass
        if pace:  # no more than _LAG blocks ahead of the follower's adds
            while gl.atomic_add(done_ptr, 0, sem="relaxed", scope="gpu") < j - _LAG:
                pass
        _store_piece(row_ptr + (2 * WG * _QD) * (1 + (MODE == 3)), offs_dd, acc, mask, follower, paired,
                     i64_scale, on, MODE)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, ))
        nxt = _dkv_piece(p_smem.index(z), ds_smem.index(z), do_smem, q_smem, 2 * WG + 1 + z, 0, dkv_zero)
        _store_piece(row_ptr + (2 * WG * _QD + 64) * (1 + (MODE == 3)), offs_dd, acc, mask, follower,
                     paired, i64_scale, on, MODE)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, ))
        nxt = _dkv_piece(p_smem.index(z), ds_smem.index(z), do_smem, q_smem, 2 * WG + 1 + z, 1, dkv_zero)
        _store_piece(row_ptr + ((2 * WG + 1) * _QD) * (1 + (MODE == 3)), offs_dd, acc, mask, follower,
                     paired, i64_scale, on, MODE)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(nxt, ))
        mbarrier.arrive(bars.index(_PDS_FREE))  # P and dS read for the last time
        _store_piece(row_ptr + ((2 * WG + 1) * _QD + 64) * (1 + (MODE == 3)), offs_dd, acc, mask, follower,
                     paired, i64_scale, on, MODE)
        if leader:  # publish: every thread's stores of this block, then the count (release)
            gl.thread_barrier()
            gl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")
        if follower:  # (pacing only: no ordering needed)
            gl.atomic_add(done_ptr, 1, sem="relaxed", scope="gpu")

    mbarrier.arrive(bars.index(_QD_FREE))  # q and dO may be replaced by the next tile's

    h_q = pid_h * _BH + gl.arange(0, _BH, layout=gl.SliceLayout(1, dq_l))
    d_q = WG * 2 * _QD + gl.arange(0, _QD, layout=gl.SliceLayout(0, dq_l))
    dq_ptrs = DQ + pid_t * stride_gt + h_q[:, None].to(gl.int64) * stride_gh + d_q[None, :]
    hq_ok = (h_q < H)[:, None]
    gl.store(dq_ptrs, dq0.to(DQ.dtype.element_ty), mask=hq_ok)
    gl.store(dq_ptrs + _QD, dq1.to(DQ.dtype.element_ty), mask=hq_ok)


# Same runtime integers as the Triton kernel (no recompile per T, N, H or K), plus the
# chunk's tile count and the pairing switch.
_RUNTIME_INTS = _MAIN_RUNTIME_INTS + ["n_tiles", "paired"]


@gluon.jit(do_not_specialize=_RUNTIME_INTS)
def _bwd_main_gluon_kernel(
    Q, KV, IDX, DO, LSE, DELTA, DQ, DKV, PARTIAL, FLAGS,
    T, H, N, K, t_begin, n_tiles, paired,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_dt, stride_dh,
    stride_lt, stride_gt, stride_gh,
    scale, scale_log2, i64_scale,
    D: gl.constexpr,
    MODE: gl.constexpr,
):
    gl.static_assert(D == 4 * _QD, "the Gluon backward takes D = 512")
    dtype: gl.constexpr = Q.dtype.element_ty
    quarter_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _QD], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _BK], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [4, _BH, _QD], quarter_sl)  # [D quarter]
    do_smem = gl.allocate_shared_memory(dtype, [4, _BH, _QD], quarter_sl)
    kv_smem = gl.allocate_shared_memory(dtype, [4, _BK, _QD], quarter_sl)
    # P and dS carry a unit leading dim so the consumers address them as .index(z) (see
    # _consume_tile): hoisted out of the block loop, their descriptors were spilled, and
    # each block's first reload waited behind the previous block's dKV stores.
    p_smem = gl.allocate_shared_memory(dtype, [1, _BH, _BK], p_sl)
    ds_smem = gl.allocate_shared_memory(dtype, [1, _BH, _BK], p_sl)
    bars = gl.allocate_shared_memory(gl.int64, [_N_BARS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(_QD_READY), count=128)  # cp.async arrivals of the producer's threads
    mbarrier.init(bars.index(_QD_FREE), count=2)
    for i in gl.static_range(2):
        mbarrier.init(bars.index(_KV_READY + i), count=128)
        mbarrier.init(bars.index(_KV_FREE + i), count=1)
    mbarrier.init(bars.index(_PDS_READY), count=1)
    mbarrier.init(bars.index(_PDS_FREE), count=2)

    nb = gl.cdiv(K, _BK)
    # Programs take their rank from a ticket counter (FLAGS[0], zero at launch), not from
    # program_id: the program holding a pair's odd tile then knows the one holding the
    # even tile (the rank below) has started, so its wait always ends.
    rank = gl.atomic_add(FLAGS, 1, sem="relaxed")
    c_args = (IDX, LSE, DELTA, DQ, DKV, PARTIAL, H, N, K, t_begin, n_tiles, stride_it, stride_lt, stride_gt,
              stride_gh, scale, scale_log2, i64_scale, q_smem, do_smem, kv_smem, p_smem, ds_smem, bars, nb,
              FLAGS, rank, paired)
    p_args = (Q, DO, KV, IDX, H, N, K, t_begin, n_tiles, stride_qt, stride_qh, stride_dt, stride_dh,
              stride_kvn, stride_it, q_smem, do_smem, kv_smem, bars, nb, rank)
    gl.warp_specialize([(_producer, p_args), (_consumer, (c_args, 0, MODE)), (_consumer, (c_args, 1, MODE))],
                       [4, 4], [232, 232])


def launch_main(q, kv, indices, grad_out, lse, delta, grad_q, grad_kv, partial, flags, T, H, N, K, t_begin,
                n_tok, scale, scale_log2, n_hb, paired, mode=None, i64_scale=1.0):
    """One chunk of tokens [t_begin, t_begin + n_tok): the Triton main kernel's contract,
    except that with ``paired`` (the caller's ``pairs_head_blocks``; partial rows only)
    the partial buffer holds one row per pair of head blocks. ``flags``: int32 zeros, at
    least 1 + 2 * n_tok * n_hb (the ticket, the leaders' and the followers' counts)."""
    n_tiles = n_tok * n_hb
    if paired and (partial is None or n_hb % 2):
        raise ValueError("head blocks pair up only on the partial-row path, with an even count")
    grid = min(n_tiles, cuda_properties(q.device).multi_processor_count)
    if paired:  # an even program count keeps both tiles of a pair in the same round
        grid -= grid % 2
    _bwd_main_gluon_kernel[(grid,)](
        q, kv, indices, grad_out, lse, delta, grad_q, grad_kv,
        partial if partial is not None else grad_kv, flags,
        T, H, N, K, t_begin, n_tiles, int(paired),
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), grad_out.stride(0),
        grad_out.stride(1), lse.stride(0), grad_q.stride(0), grad_q.stride(1),
        scale, scale_log2, i64_scale,
        D=q.shape[2], MODE=(0 if partial is not None else 1) if mode is None else mode,
        num_warps=NUM_WARPS, maxnreg=MAXNREG,
    )
