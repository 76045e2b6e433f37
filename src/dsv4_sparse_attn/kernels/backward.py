"""The sparse-MLA backward around its main kernel: grad_q, grad_kv, grad_sink
(docs/design.md#backward).

1. ``_bwd_delta_kernel``: Delta = rowsum(O * dO) - dLSE, fp32 [T, H].
2. The main kernel, handed in by the dispatcher (``backward_gluon`` on Hopper at D = 512,
   ``backward_triton`` elsewhere): S, P, dP, dS, grad_q, and each block's dKV rows, which
   go to (a measurement option besides: ``exact_sums``' two-word sums in one launch)
   - deterministic: per-(token, head block, slot) fp32 partial rows for a chunk of
     tokens, then ``_dkv_reduce_kernel`` sums, for every kv row, its entries in a fixed
     (sorted) order into an fp32 [N, D] accumulator: bitwise reproducible, whatever the
     chunking; or
   - fast: fp32 atomic adds straight into the accumulator (the order, and so the last
     bits, vary from run to run).
3. ``_epilogue_kernel``, one launch: the accumulator to grad_kv in kv's dtype (undoing the
   Gluon kernel's column order), grad_sink = -sum_t exp(sink - lse) * Delta (per-segment
   sums, then, by the segments' last program, their sum in a fixed order; no [T, H]
   temporary), and in the fast mode the Gluon kernel's remainder tiles' dQ parts summed.

The accumulator and the main kernel's counters are one zero-filled allocation: a fast call
launches a memset, Delta, the main kernel and the epilogue.

The chunk of tokens bounds the partial rows (``PARTIAL_BYTES``) whatever T is. With
per-token lengths and large partial rows a token (short chunks), the chunks take the tokens
longest first (``length_order``), so that a chunk's tokens have like lengths.
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import exact_sums, l2_policy
from .common import LOG2E, aligned16, cuda_properties, last_dim_contiguous, next_pow2, scale_words

# The deterministic mode's grad_kv sums where the main kernel has them: exact two-word sums
# on per-row grids in one launch (exact_sums; True), or per-slot partial rows folded in a
# sorted order (False). Off: 2.1-2.3x the fast mode's time on an H100, and the rows' bound is
# too loose for heavily shared rows (a kv row selected by thousands of slots loses most of
# its bits), so the exact sums are a measurement option (``exact=True``)
# (docs/performance/backward.md#exact-two-word-sums-measured-off).
EXACT_SUMS = False
# Without lengths, the main kernel leaves out each token's trailing masked slots: the Delta
# launch finds them (1 + the last slot with a valid id) and the main kernel takes them as
# lengths in token order (a main kernel with ``IN_ORDER``; ``launch(in_order=True)``). A
# causal indexer's ids end in -1 until its pool fills. Off: -8% / -28% of the fast mode's
# time with causal ids at H64 K640 / H128 K1152 (T = 4096, H100), but +0.8-1.2% where every
# slot is valid, and the deterministic mode +7% at K = 160
# (docs/performance/backward.md#the-remainders-launch-started-early-pdl).
TRAILING_MASKED_SKIPPED = False

# The deterministic mode's partial rows in 16 bits (fp16, a power-of-two scale a 64-column
# segment; the fold decodes them exactly and sums in fp32, in the same fixed order) where the
# main kernel takes them by default (its ``partial16_default``: the Gluon kernel at D = d_v =
# 512 and at the 576/512 layout, where timed under the running Triton). H100, Triton 3.6,
# 6c434da: 19-30% less time than fp32 rows (H16-H128, T = 4096 to 131072; 576/512 at
# a6ce034 and 6c93a65: 23-24% at H = 16 and 32, 19% at H = 64, 1-4% at H = 128), grad_kv
# within 8.7e-4 of the fp32 rows' (its own bf16 rounding is 1.7e-3)
# (docs/performance/backward.md#partial-rows-in-16-bits).
PARTIAL_16 = True
# The 16-bit partial rows as bf16, unscaled, instead of scaled fp16 (a measurement option, off;
# the Gluon main kernel at D = d_v = 512): no segment maxima, scales or multiplies in the
# main kernel (26% of its block loop's instructions, sm_90) and no scale words in the fold,
# for each row rounded to bf16 (grad_kv's error about 1.4x its own bf16 rounding, against
# 1.01x with scaled fp16: docs/performance/backward.md#partial-rows-in-16-bits). H100, T = 4096:
# the call 2.6-7.0% shorter (H64 K640 3.2%), not enough to trade the precision for
# (docs/performance/backward.md#what-the-deterministic-main-kernel-pays-for-its-16-bit-rows-measured).
PARTIAL_16_BF16 = False
# The deterministic mode's fold of chunk c - 1 inside chunk c's main kernel (off; a main
# kernel whose ``folds_in_main`` takes the widths: the Gluon one at D = d_v = 512, with
# 16-bit rows, unpaired, one or two head blocks, where the fold goes by rows): each entry's
# partial row stored at its rank in the chunk's sorted order (``_Inverter(ranks=True)``),
# so that a kv row's entries are consecutive rows, and the previous chunk's rows folded by
# the producer warp group between its gathers (``fold_gluon``). Two buffers of half the
# budget; the last chunk is folded alone, by rows in the sorted layout
# (``_dkv_reduce_kernel(SORTED=True)``). The same bits as the fold beside. H100, T = 4096:
# slower (H64 K640 4.93 ms against 3.63: its fold steps hold up the gathers), so off
# (docs/performance/backward.md#the-fold-inside-the-main-kernel-built-measured-slower-off).
# "beside" (a measurement arm): the same sorted layout and chunks, each chunk folded right
# after its main kernel, not inside the next one (what the layout and the smaller chunks
# cost apart from the fold's place). "nofold" (timing only, wrong grad_kv): the same
# launches with no fold at all, the design's ceiling with its chunks.
FOLD_IN_MAIN = False
# With FOLD_IN_MAIN, the chunks' launches chained (off): each starts the next as its programs
# start (programmatic dependent launch), so that the next chunk's tiles take the SMs its
# last programs leave instead of waiting for them; counters order the fold (chunk c's
# programs fold chunk c - 1 once all its rows are stored and chunk c - 2's fold has ended)
# and the buffers (three of a third of the budget: chunk c's rows overwrite chunk c - 3's
# once their fold has ended). The same bits. Off: measured slower with the fold (H100, H64 K640:
# 5.13 ms against 3.54 shipped; docs/performance/backward.md, "The fold inside the main kernel").
FOLD_CHAIN = False

# Bound on the deterministic path's per-slot fp32 dKV buffer (the whole extra memory
# of the backward is this plus O(T*H + N*D) fp32): under the 1 GiB the backward may
# use, and as large as that allows, since fewer chunks mean fewer partial waves.
PARTIAL_BYTES = 896 * 2**20

# The fast mode's main launch with part of the fp32 accumulator in the L2's persisting
# set-aside (``l2_policy.window``) where the accumulator is at least L2_PERSIST_MIN_L2 times
# the L2 (None: never); the epilogue's launch gives the lines back (``persist_rows``: which
# rows). Off: at T = 131072 causal H64 K640 it takes 13% off on an H100 SXM and 7.9% on the
# H200 (87.8 -> 80.9 ms), but on the H200 the set-aside reserved without any window gains
# as much, and while it stays reserved it costs the process's mid-sized calls 40-46%
# (T = 32768, 65536); changing the reservation (cuCtxSetLimit) synchronises the device
# (docs/performance/backward.md#the-accumulator-in-the-l2s-persisting-set-aside).
L2_PERSIST_MIN_L2 = None

# The deterministic path inverts the ids of several chunks with one batched stable sort
# (and one searchsorted): its host work per chunk is then two launches, not a dozen
# PyTorch calls (with short per-token lengths the chunks' kernels got shorter than the
# host's work for them). At most this many (token, slot) entries a sort: about 24 bytes
# an entry at its peak (int16 keys and their sorted copy, int64 positions, the sort's own
# buffers), 48 MiB.
SORT_ENTRIES = 2**21

# The deterministic path's id inversions on a second stream (``beside_stream``): the first
# group's beside the Delta launch, each later group's beside the fold of the chunk before
# it, never beside a main kernel (whose programs each need a whole SM). Each inversion's
# sort is a dozen short kernels (keys, the radix passes, searchsorted) that leave most of
# the GPU idle; beside a kernel bound by the HBM they cost about the bytes they move.
# False: inline, on the caller's stream.
SORT_BESIDE = True

# Partial-row bytes a token from which the deterministic mode with per-token lengths takes
# the tokens longest first (``length_order``). A function of the shape only, so the bits
# do not depend on the chunking. H200, T = 4096, lengths uniform in [128, K], kernels' time
# (benchmarks/experiments/chunk_order_bench.py): 4 MiB a token (H64 K2048: chunks of one
# wave, one token a program) 7.38 ms against 9.62 in token order, 4.5 MiB (576/512 K2048)
# 9.28 against 12.07; 2.25 MiB (H128 K1152, five tiles a program a chunk) 7.62 against
# 7.39, 1.25 MiB (H64 K640) level: where a chunk's programs take several tiles each, the
# balanced order within it (``schedule``) already evens them out, and token order keeps a
# chunk's window rows few (a cheaper fold).
LENGTH_ORDER_MIN_BYTES = 3 * 2**20

# Columns a program of the deterministic fold where D is a multiple: a whole
# 2 KB partial row at D = 512, so an entry's row is read in one piece by one program (H200,
# one chunk of H64 K640: 3.84 TB/s against 3.25 for two 1 KB halves read by two programs at
# different times; docs/performance/backward.md#whole-partial-rows-a-fold-program-kept).
FOLD_BLOCK_D = 512
# Columns a program where D is not a multiple (D = 576), the last block masked: with one
# kv row a program the whole row too (1024 columns, 448 of them masked; H200, D = 576,
# T = 4096: the deterministic backward 7-11% faster than with three 256-column programs a
# row, 5-7% faster than with two of 512); in the four-row tile 256 (1024 columns would
# take 206 registers there).
FOLD_BLOCK_D_MASKED = 1024
FOLD_BLOCK_D_MASKED_TILE = 256

# The fold cut by entries (``_dkv_fold_runs_kernel``) instead of by kv rows: None = where
# ``fold_runs`` takes it (more than FOLD_RUNS_MIN_ROWS kv rows an SM: long contexts, where a
# chunk leaves most rows without entries), True / False = always / never. Its (entries a
# step, warps, programs an SM, accumulator rows loaded with the entries rather than when
# their row starts). H200, deterministic backward, causal ids, T = 131072
# (benchmarks/experiments/fold_runs_bench.py): H64 K640 136.4 ms against 154.2 by rows,
# H128 K1152 392.0 against 417.1; (4, 4, 8) 147 / 409, (8, 2, 16) 155 / 418, without the
# preload 159-160 / 425; at 576/512 (1024-column programs, 448 columns masked) 169.3 against
# 207.9 and 469.8 against 541.8, (8, 2, 16) 183.5 / 492.8; at T = 4096 and 32768 (rows of
# tens to hundreds of entries: one row a program reads at 3.8 TB/s) 8-38% slower in
# (8 | 4, 4, 4 | 8) configurations.
FOLD_RUNS = None
# The fold by rows' programs in reverse row order. The GPU starts a grid's programs about in
# their order, so the rows with the most entries should come first; in DeepSeek's layout
# those are the pool rows, stored after the raw ones (T = 4096, H64 K640: 660 entries a
# pool row a chunk against about 120 a window row), and the fold in row order ended on
# them. H100, T = 4096, the deterministic backward 1.6-3.5% faster with one head block,
# level at T = 32768 (benchmarks/experiments/det_fold_sort_bench.py;
# docs/performance/backward.md#the-folds-longest-rows-first-kept). Any order, the same bits.
FOLD_ROWS_REVERSED = True
FOLD_RUNS_CONFIG = (4, 2, 16, True)
# kv rows an SM beyond which a chunk leaves most rows without entries (long contexts): the
# fold by rows takes several rows a program there (``fold_tile``), the fold by entry runs
# takes over (``fold_runs``)
FOLD_RUNS_MIN_ROWS = 512


@triton.jit(do_not_specialize=["t_lo", "n_tok", "K", "stride_t", "N", "n"])
def _sort_keys_kernel(IDX, LEN, TOK, KEYS, t_lo, n_tok, K, stride_t, N, n,
                      HAS_TOK: tl.constexpr, HAS_LEN: tl.constexpr, BLOCK: tl.constexpr):
    """KEYS[e] for the flat (position - t_lo, slot) entries e < n: the entry's kv row, or N
    where it adds nothing (id < 0 or >= N, slot past the token's length, position past the
    last one): N sorts after every row. Position p holds token p, or TOK[p]
    (``length_order``)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    pos = e // K
    slot = e - pos * K
    ok = (e < n) & (pos < n_tok)
    if HAS_TOK:
        tok = tl.load(TOK + t_lo + pos, mask=ok, other=0).to(tl.int64)
    else:
        tok = t_lo + pos
    ids = tl.load(IDX + tok * stride_t + slot, mask=ok, other=-1).to(tl.int64)
    ok &= (ids >= 0) & (ids < N)
    if HAS_LEN:
        ok &= slot < tl.load(LEN + tok, mask=ok, other=0)
    tl.store(KEYS + e, tl.where(ok, ids, N).to(KEYS.dtype.element_ty), mask=e < n)


@triton.jit(do_not_specialize=["H", "stride_gt"])
def _bwd_delta_kernel(
    OUT, DO, DLSE, DELTA, IDX, TRAIL,
    H, N, K, stride_ot, stride_oh, stride_dt, stride_dh, stride_gt, stride_it,
    D: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DLSE: tl.constexpr, HAS_TRAIL: tl.constexpr,
    BLOCK_K: tl.constexpr = 128,
):
    pid_t = tl.program_id(0).to(tl.int64)
    if HAS_TRAIL:
        # TRAIL[t]: 1 + the token's last slot with an id in [0, N) (0 if none), so that the
        # main kernel leaves out the blocks of masked slots only (a causal indexer's -1 tail)
        if tl.program_id(1) == 0:
            offs_k = tl.arange(0, BLOCK_K)
            last = tl.zeros([BLOCK_K], dtype=tl.int32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + offs_k
                ids = tl.load(IDX + pid_t * stride_it + k, mask=k < K, other=-1)
                last = tl.maximum(last, tl.where((ids >= 0) & (ids < N), k + 1, 0))
            tl.store(TRAIL + pid_t, tl.max(last, 0))
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


@triton.jit
def _entry_rows(PARTIAL, ORDER, e, end, K, k_stride, offs_d, d_ok, N_HB: tl.constexpr, D: tl.constexpr,
                MASK_D: tl.constexpr, EXP=None, P16: tl.constexpr = False, SORTED: tl.constexpr = False):
    """[ROWS, BLOCK_D]: for each of the program's rows, its entry ``e`` (its head-block parts
    added in order), 0 where ``e`` is past the row's ``end``. ``SORTED`` (``FOLD_IN_MAIN``):
    the rows in the sorted layout, entry e's part p at row (e + 1) N_HB + p (ORDER unread)."""
    ok = e < end
    cols = _runs_of_4(offs_d) if P16 else offs_d
    if SORTED:
        row0 = (e.to(tl.int64) + 1) * N_HB
        ptr = (PARTIAL + row0 * D)[:, None] + cols[None, :]
        m = ok[:, None]
        if MASK_D:
            m = m & d_ok[None, :]
        ew = None
        if P16:
            ew = EXP + row0 * scale_words(D, P16 == 2)
        # (parts one row apart: k_stride 1)
        return _sum_parts(ptr, m, 1, N_HB, D, ew, ok, offs_d[None, :], P16, TILE=True)
    entry = tl.load(ORDER + e, mask=ok, other=0)  # flat (token-in-chunk, slot)
    ptr = _partial_row(PARTIAL, entry, K, k_stride, N_HB, D)[:, None] + cols[None, :]
    if MASK_D:
        m = ok[:, None] & d_ok[None, :]
    else:  # (a mask constant along the row: 16-byte loads)
        m = ok[:, None]
    ew = None
    if P16:  # (each row's scale words, one load a row, broadcast along it)
        ew = _partial_row(EXP, entry, K, k_stride, N_HB, scale_words(D, P16 == 2))
    return _sum_parts(ptr, m, k_stride, N_HB, D, ew, ok, offs_d[None, :], P16, TILE=True)


@triton.jit
def _runs_of_4(offs):
    """``offs`` (contiguous columns) written as runs of 4: the same values, which the
    compiler sees as contiguous 4 at a time, so loads of fp16 rows take 4 values a thread
    as the fp32 accumulator's loads do, with no layout conversion between them (with the
    plain columns the fp16 loads took 8, and each sum went through shared memory)."""
    return (offs // 4) * 4 + offs % 4


@triton.jit
def _partial_row(PARTIAL, entry, K, k_stride, N_HB: tl.constexpr, D: tl.constexpr):
    """The first of the partial rows of ``entry`` (flat (token-in-chunk, slot); any shape):
    ``[chunk tokens, N_HB parts, k_stride slots, D]``."""
    # (in 32 bits: a chunk's entries number fewer than 2^31 (``chunk_tokens``), and a 64-bit
    # division costs each entry about a hundred instructions, a fold's largest share)
    e32 = entry.to(tl.int32)
    tok = e32 // K
    slot = e32 - tok * K
    return PARTIAL + ((tok.to(tl.int64) * N_HB) * k_stride + slot) * D


@triton.jit
def _sum_parts(ptr, m, k_stride, N_HB: tl.constexpr, D: tl.constexpr, ew=None, ok=None, cols=None,
               P16: tl.constexpr = False, TILE: tl.constexpr = False):
    """An entry's partial row, its N_HB head-block parts (``ptr``: the first's columns)
    added in part order. ``P16`` (16-bit partial rows, ``sparse_mla_bwd(partial16=...)``;
    docs/performance/backward.md#partial-rows-in-16-bits):
    the rows are fp16 and each 64-column segment has a power-of-two scale, its biased
    exponent a byte of the part's int64 scale words at ``ew`` (``(D / 64 + 7) / 8``; loaded
    where ``ok``; ``TILE``: see ``_scaled``); ``cols`` are the values' columns. The value,
    the fp16 times the scale, is exact in fp32."""
    x = tl.load(ptr, mask=m, other=0.0)
    if P16:
        x = _scaled(x, ew, ok, cols, D, TILE, P16)
    for hb in tl.static_range(1, N_HB):
        y = tl.load(ptr + hb * k_stride * D, mask=m, other=0.0)
        if P16:
            y = _scaled(y, ew + hb * k_stride * scale_words(D, P16 == 2), ok, cols, D, TILE, P16)
        x += y
    return x


@triton.jit
def _scaled(x, ew, ok, cols, D: tl.constexpr, TILE: tl.constexpr, P16: tl.constexpr):
    """fp16 ``x`` (columns ``cols``) times its segment's scale: the segment's byte of the
    words at ``ew`` is the scale's biased exponent, so the float is built from its bits.
    Segments of 64 columns, byte ``cols // 64``; with ``P16 == 2`` (rows with 64 score-only
    columns last: the Gluon kernel splits those between its two consumers) the last 64
    columns are two segments of 32, bytes ``(D - 64) / 64`` and one more (``scale_words``).
    One word load (two past 8 segments) an entry and part, not a byte load a value: ``ew``
    is a scalar or, with ``TILE``, one pointer a row of the tile ([ROWS], loaded so and
    widened after: a [ROWS, 1] load would be repeated for each value a thread holds)."""
    if P16 == 3:  # (bf16 rows, unscaled: PARTIAL_16_BF16)
        y = x.to(tl.float32)
    else:
        NW: tl.constexpr = scale_words(D, P16 == 2)
        tl.static_assert(NW <= 2)
        b = cols // 64
        if P16 == 2:
            b += (cols >= D - 64) & ((cols // 32) % 2 == 1)
        w = tl.load(ew, mask=ok, other=0)
        lo = w.to(tl.int32)
        hi = (w >> 32).to(tl.int32)
        if TILE:
            lo = lo[:, None]
            hi = hi[:, None]
        half = tl.where((b // 4) % 2 == 0, lo, hi)
        if NW == 2:
            w2 = tl.load(ew + 1, mask=ok, other=0).to(tl.int32)
            if TILE:
                w2 = w2[:, None]
            half = tl.where(b < 8, half, w2)
        e = (half >> ((b % 4) * 8)) & 0xFF
        y = x.to(tl.float32) * (e << 23).to(tl.float32, bitcast=True)
    return y


@triton.jit
def _four_entries(PARTIAL, ORDER, e, end, K, k_stride, offs_d, d_ok, N_HB: tl.constexpr, D: tl.constexpr,
                  MASK_D: tl.constexpr, EXP=None, P16: tl.constexpr = False, SORTED: tl.constexpr = False):
    """Entries e .. e + 3 of each of the program's rows (``_entry_rows``), loaded together."""
    x0 = _entry_rows(PARTIAL, ORDER, e, end, K, k_stride, offs_d, d_ok, N_HB, D, MASK_D, EXP, P16, SORTED)
    x1 = _entry_rows(PARTIAL, ORDER, e + 1, end, K, k_stride, offs_d, d_ok, N_HB, D, MASK_D, EXP, P16, SORTED)
    x2 = _entry_rows(PARTIAL, ORDER, e + 2, end, K, k_stride, offs_d, d_ok, N_HB, D, MASK_D, EXP, P16, SORTED)
    x3 = _entry_rows(PARTIAL, ORDER, e + 3, end, K, k_stride, offs_d, d_ok, N_HB, D, MASK_D, EXP, P16, SORTED)
    return x0, x1, x2, x3


@triton.jit(do_not_specialize=["K", "k_stride", "N"])
def _dkv_reduce_kernel(
    PARTIAL, ORDER, SEG, ACC, K, k_stride, N,
    D: tl.constexpr, BLOCK_D: tl.constexpr, N_HB: tl.constexpr, MASK_D: tl.constexpr, ROWS: tl.constexpr,
    UNROLL: tl.constexpr, EXP=None, P16: tl.constexpr = False, REVERSED: tl.constexpr = False,
    SORTED: tl.constexpr = False,
):
    """acc[n] += row n's per-slot partials of this chunk, one after the other in sorted
    (token, slot) order: a sequential fold that continues from the previous chunks' sum,
    so the result is the same fold whatever the chunks are (bitwise).

    A program folds ROWS consecutive kv rows side by side (a [ROWS, BLOCK_D] tile,
    ``fold_tile``), UNROLL entries of each row a step: all UNROLL x ROWS entry rows are
    loaded before any is added (straight-line code, so the loads are in flight at once),
    and each row's adds stay in order (a row past its last entry adds zeros). A row of
    the tile without entries in this chunk is neither read nor written, and a tile without
    any exits after reading its ROWS + 1 segment bounds: at long contexts most rows get no
    entry from a chunk, and rows folded one after another in a program left the fold
    waiting on each row's chain of dependent loads (T = 131072: 1.3 TB/s, against 3.3 at
    T = 4096; docs/performance/backward.md#the-fold-at-long-contexts).
    N_HB, the head-block parts per partial row (1 or 2 in practice), is compile-time.
    ``P16`` (16-bit partial rows: their scales at ``EXP``, ``_scaled``): 1, or 2 where the
    rows end in 64 score-only columns, scaled as two segments of 32. ``SORTED``: the rows in
    the sorted layout (``FOLD_IN_MAIN``; ``_entry_rows``).
    """
    tl.static_assert(UNROLL == 4 or UNROLL == 8)
    pid = tl.program_id(0)
    if REVERSED:  # (the last rows first: FOLD_ROWS_REVERSED)
        pid = tl.num_programs(0) - 1 - pid
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D  # (BLOCK_D columns a program; D = 576 ends in a quarter-used block)
    # (rows past N read SEG[N] twice: an empty segment)
    start = tl.load(SEG + tl.minimum(rows, N))
    end = tl.load(SEG + tl.minimum(rows + 1, N))
    n_max = tl.max(end - start, 0)
    if n_max > 0:
        live = (end > start)[:, None]
        if MASK_D:
            live = live & d_ok[None, :]
        acc_ptr = ACC + rows[:, None] * D + offs_d[None, :]
        acc = tl.load(acc_ptr, mask=live, other=0.0)
        for e0 in range(0, n_max, UNROLL):
            e = start + e0
            x0, x1, x2, x3 = _four_entries(PARTIAL, ORDER, e, end, K, k_stride, offs_d, d_ok, N_HB, D, MASK_D,
                                           EXP, P16, SORTED)
            if UNROLL == 8:
                x4, x5, x6, x7 = _four_entries(PARTIAL, ORDER, e + 4, end, K, k_stride, offs_d, d_ok, N_HB, D,
                                               MASK_D, EXP, P16, SORTED)
            acc += x0
            acc += x1
            acc += x2
            acc += x3
            if UNROLL == 8:
                acc += x4
                acc += x5
                acc += x6
                acc += x7
        tl.store(acc_ptr, acc, mask=live)


@triton.jit(do_not_specialize=["K", "k_stride", "N"])
def _dkv_fold_runs_kernel(
    PARTIAL, ORDER, KEYS, SEG, ACC, K, k_stride, N,
    D: tl.constexpr, BLOCK_D: tl.constexpr, N_HB: tl.constexpr, UNROLL: tl.constexpr,
    PRELOAD: tl.constexpr = True, EXP=None, P16: tl.constexpr = False,
):
    """``_dkv_reduce_kernel``'s fold (the same adds in the same order: the same bits), with
    the work cut by entries instead of by kv rows: the chunk's sorted entries (``KEYS``, the
    sorted kv rows; ``ORDER``, their positions) are split into equal runs, one a program,
    each run moved to the first row that starts in it, so a program folds whole rows, the
    rows whose first entry lies in its run. Its entries are contiguous, so UNROLL of them
    (and the accumulator rows of the rows that start among them) are loaded before any is
    added, across row boundaries; no program is scheduled for the rows without entries (at
    long contexts most of the N rows get none from a chunk).
    """
    p = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_valid = tl.load(SEG + N)  # entries that add something (the others are keyed N, last)
    per = (n_valid + n_prog - 1) // n_prog
    e_lo = _run_start(KEYS, SEG, p * per, n_valid)
    e_hi = _run_start(KEYS, SEG, (p + 1) * per, n_valid)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    cur = tl.full([], -1, tl.int64)  # the row being folded (-1: none yet)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for e0 in range(e_lo, e_hi, UNROLL):
        # loads first (straight-line code, all in flight at once): the entries' rows and
        # positions, their partial rows, the accumulator row of each entry that starts a row
        r0, x0, s0, a0 = _run_entry(PARTIAL, ORDER, KEYS, ACC, e0, e_hi, cur, K, k_stride, offs_d, d_ok,
                                    N_HB, D, PRELOAD, EXP, P16)
        r1, x1, s1, a1 = _run_entry(PARTIAL, ORDER, KEYS, ACC, e0 + 1, e_hi, r0, K, k_stride, offs_d, d_ok,
                                    N_HB, D, PRELOAD, EXP, P16)
        r2, x2, s2, a2 = _run_entry(PARTIAL, ORDER, KEYS, ACC, e0 + 2, e_hi, r1, K, k_stride, offs_d, d_ok,
                                    N_HB, D, PRELOAD, EXP, P16)
        r3, x3, s3, a3 = _run_entry(PARTIAL, ORDER, KEYS, ACC, e0 + 3, e_hi, r2, K, k_stride, offs_d, d_ok,
                                    N_HB, D, PRELOAD, EXP, P16)
        if UNROLL == 8:
            r4, x4, s4, a4 = _run_entry(PARTIAL, ORDER, KEYS, ACC, e0 + 4, e_hi, r3, K, k_stride,
                                        offs_d, d_ok, N_HB, D, PRELOAD, EXP, P16)
            r5, x5, s5, a5 = _run_entry(PARTIAL, ORDER, KEYS, ACC, e0 + 5, e_hi, r4, K, k_stride,
                                        offs_d, d_ok, N_HB, D, PRELOAD, EXP, P16)
            r6, x6, s6, a6 = _run_entry(PARTIAL, ORDER, KEYS, ACC, e0 + 6, e_hi, r5, K, k_stride,
                                        offs_d, d_ok, N_HB, D, PRELOAD, EXP, P16)
            r7, x7, s7, a7 = _run_entry(PARTIAL, ORDER, KEYS, ACC, e0 + 7, e_hi, r6, K, k_stride,
                                        offs_d, d_ok, N_HB, D, PRELOAD, EXP, P16)
        # then the adds in entry order, each row's sum stored when the next row starts
        acc, cur = _run_add(ACC, acc, cur, r0, x0, s0, a0, offs_d, d_ok, D, PRELOAD)
        acc, cur = _run_add(ACC, acc, cur, r1, x1, s1, a1, offs_d, d_ok, D, PRELOAD)
        acc, cur = _run_add(ACC, acc, cur, r2, x2, s2, a2, offs_d, d_ok, D, PRELOAD)
        acc, cur = _run_add(ACC, acc, cur, r3, x3, s3, a3, offs_d, d_ok, D, PRELOAD)
        if UNROLL == 8:
            acc, cur = _run_add(ACC, acc, cur, r4, x4, s4, a4, offs_d, d_ok, D, PRELOAD)
            acc, cur = _run_add(ACC, acc, cur, r5, x5, s5, a5, offs_d, d_ok, D, PRELOAD)
            acc, cur = _run_add(ACC, acc, cur, r6, x6, s6, a6, offs_d, d_ok, D, PRELOAD)
            acc, cur = _run_add(ACC, acc, cur, r7, x7, s7, a7, offs_d, d_ok, D, PRELOAD)
    tl.store(ACC + cur * D + offs_d, acc, mask=tl.where(cur >= 0, d_ok, False))


@triton.jit
def _run_entry(PARTIAL, ORDER, KEYS, ACC, e, e_hi, prev, K, k_stride, offs_d, d_ok, N_HB: tl.constexpr,
               D: tl.constexpr, PRELOAD: tl.constexpr, EXP=None, P16: tl.constexpr = False):
    """Entry ``e`` of a run: (its kv row, -1 past the run; its partial row, head-block parts
    added in order, 0 past the run; whether it starts a row, i.e. follows an entry of
    another row ``prev``; that row's accumulator where it does, else 0)."""
    ok = e < e_hi
    r = tl.load(KEYS + e, mask=ok, other=-1).to(tl.int64)
    entry = tl.load(ORDER + e, mask=ok, other=0)
    base = _partial_row(PARTIAL, entry, K, k_stride, N_HB, D)
    m = tl.where(ok, d_ok, False)  # (a scalar & a vector: not a mask the 3.9 interpreter takes)
    ew = None
    cols = offs_d
    if P16:  # (the entry's scale words: one load, broadcast along the row)
        ew = _partial_row(EXP, entry, K, k_stride, N_HB, scale_words(D, P16 == 2))
        cols = _runs_of_4(offs_d)
    x = _sum_parts(base + cols, m, k_stride, N_HB, D, ew, ok, offs_d, P16)
    st = ok & (r != prev)
    if PRELOAD:
        a = tl.load(ACC + r * D + offs_d, mask=tl.where(st, d_ok, False), other=0.0)
    else:  # (loaded by _run_add when the row starts)
        a = x
    return r, x, st, a


@triton.jit
def _run_add(ACC, acc, cur, r, x, st, a, offs_d, d_ok, D: tl.constexpr, PRELOAD: tl.constexpr):
    """One entry of a run added: where it starts a row, the previous row's sum is stored
    and the sum continues from the new row's accumulator (an entry past the run, r = -1 and
    st false, adds nothing)."""
    tl.store(ACC + cur * D + offs_d, acc, mask=tl.where(st & (cur >= 0), d_ok, False))
    if not PRELOAD:
        a = tl.load(ACC + r * D + offs_d, mask=tl.where(st, d_ok, False), other=0.0)
    acc = tl.where(st, a, acc)
    cur = tl.where(st, r, cur)
    acc = tl.where(r >= 0, acc + x, acc)
    return acc, cur


@triton.jit
def _run_start(KEYS, SEG, e, n_valid):
    """The first entry at or after ``e`` that starts a kv row (n_valid if none)."""
    e = tl.minimum(e, n_valid)
    r = tl.load(KEYS + e, mask=e < n_valid, other=0).to(tl.int64)
    s = tl.load(SEG + r, mask=e < n_valid, other=0)
    nxt = tl.load(SEG + r + 1, mask=e < n_valid, other=0)
    return tl.where(e >= n_valid, n_valid, tl.where(s == e, e, nxt))


@triton.jit
def _acc_rows_to_kv(ACC, OUT, N, rb, cb, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                    FAKE_ORDER: tl.constexpr, TWO_WORDS: tl.constexpr = False):
    """grad_kv[n, c] = acc[n, c'] in kv's dtype for rows block ``rb``, columns block ``cb``;
    c' = c or, for the fake-ordered accumulator, hopper.fake_col(c) (a permutation within
    each 16-column group). BLOCK_C: a multiple of 16 dividing D. ``TWO_WORDS``: rows of
    2 D, the value acc[n, c'] + acc[n, D + c'] (exact_sums' hi and lo words)."""
    rows = rb.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    if FAKE_ORDER:
        src = (c & ~15) | (((c & 7) >> 1) << 2) | (((c >> 3) & 1) << 1) | (c & 1)
    else:
        src = c
    m = (rows < N)[:, None]
    if TWO_WORDS:
        ptr = ACC + rows[:, None] * (2 * D) + src[None, :]
        x = tl.load(ptr, mask=m, other=0.0) + tl.load(ptr + D, mask=m, other=0.0)
    else:
        x = tl.load(ACC + rows[:, None] * D + src[None, :], mask=m, other=0.0)
    tl.store(OUT + rows[:, None] * D + c[None, :], x.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _sink_part(SINK, LSE, DELTA, PART, seg, hb, T, H, stride_lt, SEG_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """PART[seg, h] = -sum over the rows t of segment ``seg`` (SEG_T rows) of
    exp(sink[h] - lse[t, h]) * Delta[t, h] for the heads of block ``hb``."""
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    sink = tl.load(SINK + offs_h, mask=h_ok, other=0.0)
    offs_t = (seg * SEG_T + tl.arange(0, SEG_T)).to(tl.int64)
    m = (offs_t < T)[:, None] & h_ok[None, :]
    lse = tl.load(LSE + offs_t[:, None] * stride_lt + offs_h[None, :], mask=m, other=0.0)
    delta = tl.load(DELTA + offs_t[:, None] * H + offs_h[None, :], mask=m, other=0.0)
    # (masked lanes add exact zeros, whatever the sink: exp(inf) * 0 would be NaN)
    part = tl.sum(tl.where(m, tl.exp(sink[None, :] - lse) * delta, 0.0), 0)
    tl.store(PART + seg * H + offs_h, -part, mask=h_ok)


@triton.jit
def _sum_sink_parts(PART, GRAD_SINK, H, n_seg, SUM_SEG: tl.constexpr, SUM_H: tl.constexpr):
    """grad_sink[h] = sum over the segments of PART[:, h]: tiles of SUM_SEG segments in
    segment order (the same order whichever program runs it). The loads bypass L1: the
    parts were written by other programs."""
    for h0 in range(0, H, SUM_H):
        offs_h = h0 + tl.arange(0, SUM_H)
        h_ok = offs_h < H
        acc = tl.zeros([SUM_H], tl.float32)
        for s0 in range(0, n_seg, SUM_SEG):
            offs_s = s0 + tl.arange(0, SUM_SEG)
            m = (offs_s < n_seg)[:, None] & h_ok[None, :]
            x = tl.load(PART + offs_s[:, None].to(tl.int64) * H + offs_h[None, :], mask=m, other=0.0,
                        cache_modifier=".cg")
            acc += tl.sum(x, 0)
        tl.store(GRAD_SINK + offs_h, acc, mask=h_ok)


@triton.jit
def _dq_part_rows(DQF, DQ, i, h, t_begin, n_full, n_parts, n_hb, H, stride_gt, stride_gh, D: tl.constexpr,
                  BH: tl.constexpr):
    """Head h of remainder tile n_full + i (the Gluon main kernel's fast mode cuts the tiles
    past its last whole round into parts): the sum of its parts' fp32 dQ rows in part order
    (so the same bits whichever part finished first), into DQ's dtype."""
    tile = n_full + i
    head = (tile % n_hb) * BH + h
    if head < H:
        d = tl.arange(0, D)
        acc = tl.zeros([D], dtype=tl.float32)
        for p in range(0, n_parts):
            acc += tl.load(DQF + ((i * n_parts + p) * BH + h).to(tl.int64) * D + d)
        t = t_begin + tile // n_hb
        tl.store(DQ + t.to(tl.int64) * stride_gt + head * stride_gh + d, acc.to(DQ.dtype.element_ty))


@triton.jit
def _dq_parts_kernel(DQF, DQ, t_begin, n_full, n_parts, n_hb, H, stride_gt, stride_gh, D: tl.constexpr,
                     BH: tl.constexpr):
    """Program (i, h): ``_dq_part_rows`` of remainder tile n_full + i, head h."""
    _dq_part_rows(DQF, DQ, tl.program_id(0), tl.program_id(1), t_begin, n_full, n_parts, n_hb, H, stride_gt,
                  stride_gh, D, BH)


class DqParts(NamedTuple):
    """The remainder tiles' dQ parts of a fast-mode launch (``backward_gluon.launch``):
    ``dqf`` fp32 [n_rem * n_parts, bh, D], to be summed into ``grad_q``'s rows of tiles
    n_full .. n_full + n_rem - 1 (tile = token * n_hb + head block, from token t_begin)."""
    dqf: torch.Tensor
    grad_q: torch.Tensor
    t_begin: int
    n_full: int
    n_parts: int
    n_rem: int
    n_hb: int
    bh: int


def sum_dq_parts(job: DqParts) -> None:
    """The parts' sum in a launch of its own (a main-kernel launch outside the backward's
    epilogue: tests and experiments)."""
    H = job.grad_q.shape[1]
    _dq_parts_kernel[(job.n_rem, job.bh)](
        job.dqf, job.grad_q, job.t_begin, job.n_full, job.n_parts, job.n_hb, H, job.grad_q.stride(0),
        job.grad_q.stride(1), D=job.grad_q.shape[2], BH=job.bh, num_warps=4)


# (the epilogue's sizes that change with the call: no specialisation, so no recompile)
_EPILOGUE_RUNTIME = ["N", "n_conv", "T", "stride_lt", "n_seg", "n_dq", "dq_t_begin", "dq_n_full",
                     "dq_n_parts", "stride_gt"]


@triton.jit(do_not_specialize=_EPILOGUE_RUNTIME)
def _epilogue_kernel(ACC, GRAD_KV, N, n_conv, SINK, LSE, DELTA, PART, GRAD_SINK, TICKET, T, H, stride_lt,
                     n_seg, DQF, DQ, n_dq, dq_t_begin, dq_n_full, dq_n_parts, dq_n_hb, stride_gt, stride_gh,
                     D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                     FAKE_ORDER: tl.constexpr, HAS_SINK: tl.constexpr, SEG_T: tl.constexpr,
                     BLOCK_H: tl.constexpr, SUM_SEG: tl.constexpr, SUM_H: tl.constexpr, HAS_DQ: tl.constexpr,
                     DQ_BH: tl.constexpr, TWO_WORDS: tl.constexpr = False):
    """The backward's last launch. Programs [0, n_conv): the accumulator to grad_kv, a
    [BLOCK_N, BLOCK_C] tile each. Then (with a sink) one (segment, head block) of grad_sink's
    parts each; the last of them to finish (a ticket: TICKET, int32, zero before the
    launch) sums the parts into grad_sink. The last n_dq programs (``HAS_DQ``): the fast
    mode's remainder tiles' dQ parts summed (``_dq_part_rows``: tile i // DQ_BH, head
    i % DQ_BH). (One launch for what took four: the conversion, the dQ parts, grad_sink's
    parts and PyTorch's sum of them; a call's host time is spread over its launches,
    docs/performance/backward.md#a-calls-host-time-taken-apart-measured.)"""
    pid = tl.program_id(0)
    n_hb = tl.cdiv(H, BLOCK_H)
    n_sink = n_seg * n_hb
    if pid < n_conv:
        n_cb: tl.constexpr = D // BLOCK_C
        _acc_rows_to_kv(ACC, GRAD_KV, N, pid // n_cb, pid % n_cb, D, BLOCK_N, BLOCK_C, FAKE_ORDER, TWO_WORDS)
    elif pid < n_conv + n_sink:
        if HAS_SINK:
            s = pid - n_conv
            _sink_part(SINK, LSE, DELTA, PART, s // n_hb, s % n_hb, T, H, stride_lt, SEG_T, BLOCK_H)
            # Every thread's part stored before one thread takes the ticket with release
            # semantics; the last program's acquire then sees every program's part.
            tl.debug_barrier()
            done = tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu")
            if done == n_sink - 1:
                _sum_sink_parts(PART, GRAD_SINK, H, n_seg, SUM_SEG, SUM_H)
    else:
        if HAS_DQ:  # (D = 512 only: the parts exist only there)
            i = pid - n_conv - n_sink
            _dq_part_rows(DQF, DQ, i // DQ_BH, i % DQ_BH, dq_t_begin, dq_n_full, dq_n_parts, dq_n_hb, H,
                          stride_gt, stride_gh, D, DQ_BH)


def fold_block_d(D: int, rows: int = 1) -> int:
    """Columns a program of the deterministic fold with ``rows`` kv rows a program
    (``fold_tile``): ``FOLD_BLOCK_D`` where D is a multiple, else ``FOLD_BLOCK_D_MASKED``
    (one row) or ``FOLD_BLOCK_D_MASKED_TILE`` (several) with the last block masked (576: the
    64-column programs of gcd(576, 256) left the fold with a quarter of the loads in flight
    and nine reads of each entry's position); D itself where it is a smaller power of two."""
    masked = FOLD_BLOCK_D_MASKED if rows == 1 else FOLD_BLOCK_D_MASKED_TILE
    return min(FOLD_BLOCK_D if D % FOLD_BLOCK_D == 0 else masked, next_pow2(D))


def fold_tile(N: int, n_sm: int, n_part: int = 1) -> tuple[int, int, int]:
    """(ROWS, UNROLL, num_warps) of the deterministic fold. One kv row a program, up to
    N = 512 rows an SM (T = 4096: N = 5120, every row touched, long segments), eight
    entries a step where an entry is one partial row, four where it is ``n_part`` = 2
    head-block parts (H = 128 with 16-bit rows: the same bytes in flight; H100, T = 4096,
    the deterministic backward 2.9-3.5% faster than with eight, with the rows reversed:
    ``FOLD_ROWS_REVERSED``); beyond, where a chunk touches few of the N rows (T = 131072,
    H = 64, K = 640: about 34k of 163,840) and each has few entries, four rows side by
    side, four entries a step (120 registers with 512 columns, 80 with 256, under Triton 3.6). H200,
    deterministic backward, H64 K640, causal ids, 256 columns
    (benchmarks/experiments/fold_tile_bench.py): T = 131072 165.8 ms against 178.7 with one
    row a program, T = 32768 39.7 against 38.1; with 512 columns 154 ms at T = 131072
    (fold_width_bench.py). Any tile gives the same bits."""
    if n_sm <= 0 or N <= n_sm * FOLD_RUNS_MIN_ROWS:
        return 1, 8 if n_part == 1 else 4, 4
    return 4, 4, 4


def fold_runs(N: int, n_sm: int) -> bool:
    """Whether the deterministic fold is cut by entries (``_dkv_fold_runs_kernel``) rather
    than by kv rows (``_dkv_reduce_kernel``): ``FOLD_RUNS`` where set, else beyond
    ``FOLD_RUNS_MIN_ROWS`` kv rows an SM, at any D (measured at D = 512 and at 576, whose
    rows are 1024-column programs with 448 columns masked: 13-19% shorter deterministic
    calls at T = 131072). A function of the shape; the bits are the same either way."""
    if FOLD_RUNS is not None:
        return bool(FOLD_RUNS)
    return n_sm > 0 and N > n_sm * FOLD_RUNS_MIN_ROWS


def chunk_tokens(T: int, n_hb: int, K: int, D: int, budget: int, n_sm: int = 0) -> int:
    """Tokens per chunk so that the per-slot fp32 dKV buffer stays under ``budget``.

    With ``n_sm`` (the GPU's SM count) a chunk smaller than T is rounded down to whole
    waves of programs (one program per SM at D=512): a chunk of 1.7 waves leaves 30%
    of the GPU idle in its second wave, for every chunk.
    """
    per_token = max(1, n_hb * K * D * 4)
    chunk = max(1, min(T, budget // per_token))
    assert chunk * K < 2**31, "the fold numbers a chunk's entries in 32 bits"
    if n_sm and chunk < T:
        wave = math.lcm(n_sm, n_hb) // n_hb  # tokens whose programs fill whole waves
        if chunk >= wave:
            chunk -= chunk % wave
    return chunk


def exact_sums_apply(main, q: torch.Tensor, grad_out: torch.Tensor, exact: bool | None = None) -> bool:
    """Whether the deterministic mode takes the exact two-word sums (``exact_sums``) with main
    kernel ``main`` rather than the partial rows and their sorted fold: ``exact`` if given,
    else ``EXACT_SUMS`` where the main kernel has them for this width (its ``exact_sums_ok``)."""
    able = hasattr(main, "exact_sums_ok") and main.exact_sums_ok(q.shape[-1], grad_out.shape[-1])
    if exact and not able:
        raise ValueError(f"exact sums: the {main.NAME} main kernel has none at D = {q.shape[-1]}, "
                         f"d_v = {grad_out.shape[-1]}")
    return able and (EXACT_SUMS if exact is None else bool(exact))


def sparse_mla_bwd(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, scale, main,
                   deterministic: bool = True, grad_q: torch.Tensor | None = None,
                   topk_length: torch.Tensor | None = None, exact: bool | None = None,
                   partial16: bool | None = None, **main_options):
    """The backward with main kernel ``main`` (the module ``backward_gluon`` or
    ``backward_triton``; the caller checked its ``rejects``). Returns grad_q [T,H,D],
    grad_kv [N,D] in kv's dtype, grad_sink ([H] fp32, or empty without sink). CPU tensors
    run under the Triton interpreter (tests only); ``main_options`` go to ``main.launch``.
    ``exact`` (deterministic mode): the exact two-word sums (True) or the partial rows and
    their fold (False); None: ``exact_sums_apply``'s default; True in the fast mode is an
    error. ``partial16`` (deterministic mode with a main kernel that has them): the partial
    rows in 16 bits (fp16, a power-of-two scale a 64-column segment: ``PARTIAL_16``) or fp32
    (False); None: 16 bits where the main kernel takes them by default."""
    if exact and not deterministic:  # (the fast mode's fp32 sums have no exact form to take)
        raise ValueError("exact sums are a deterministic-mode option; the fast mode got exact=True")
    T, H, D = q.shape
    N, K = kv.shape[0], indices.shape[1]
    # (q, kv and dO as the Gluon kernel's 16-byte gathers need them: a copy only where a base
    # or a stride is not aligned; the Triton kernels take them either way)
    q, kv, grad_out = aligned16(q), aligned16(kv), aligned16(grad_out)
    indices, out = last_dim_contiguous(indices), last_dim_contiguous(out)
    lse, grad_lse, attn_sink = (last_dim_contiguous(x) for x in (lse, grad_lse, attn_sink))
    dev = q.device
    n_hb = triton.cdiv(H, main.tile_heads(D, H))
    k_stride = main.partial_slots(K)
    exact = deterministic and exact_sums_apply(main, q, grad_out, exact)
    one_launch = not deterministic or exact  # (the whole of T in one main launch, no partial rows)
    if partial16 is None:
        default = getattr(main, "partial16_default", None)
        partial16 = bool(PARTIAL_16 and not one_launch and default and default(D, grad_out.shape[-1]))
    if partial16 and (one_launch or not getattr(main, "PARTIAL_16", False) or D % 64):
        raise ValueError(f"16-bit partial rows: the deterministic mode's partial rows with a main kernel "
                         f"that has them, at D a multiple of 64 (here {main.NAME}, D = {D})")
    # (16-bit rows: each head block writes its own rows; pairs measured slower:
    # docs/performance/backward.md#partial-rows-in-16-bits)
    paired = main.pairs_head_blocks(n_hb, deterministic and not exact) and not partial16
    n_part = n_hb // 2 if paired else n_hb

    if grad_q is None:  # tests pass a poisoned buffer to catch unwritten elements
        grad_q = torch.empty((T, H, D), dtype=q.dtype, device=dev)
    # the epilogue's ticket and the fast mode's main-kernel counters, zeros with the
    # accumulator (one memset); the counters 16 bytes after the ticket, aligned as the
    # kernels are specialised for
    n_main_flags = main.flags_per_chunk(T, n_hb) if T > 0 and one_launch else 0
    # (exact sums: each row's hi words, then its lo words)
    acc, counters = zeroed_accumulator(N, 2 * D if exact else D, 4 + n_main_flags, dev)
    delta = torch.empty((T, H), dtype=torch.float32, device=dev)
    d_v = grad_out.shape[-1]  # Delta runs over the value columns
    # Without lengths, each token's trailing masked slots as its length, found by the Delta
    # launch (a main kernel that takes it in token order: ``in_order``)
    trail = None
    # (at D = d_v and without exact sums: the builds the GPU tests cover with it)
    if (topk_length is None and TRAILING_MASKED_SKIPPED and getattr(main, "IN_ORDER", False) and T > 0
            and grad_out.shape[-1] == D and not exact):
        trail = torch.empty((T,), dtype=torch.int32, device=dev)
    # The chunked (deterministic) path's plan, and the first group's id inversion started
    # beside the Delta launch (``SORT_BESIDE``)
    tokens = None  # with lengths: the tokens in the order the chunks take them (None: T's)
    chunked = T > 0 and not one_launch
    if chunked:
        n_sm = cuda_properties(dev).multi_processor_count if dev.type == "cuda" else 0
        # (16-bit rows: 2 bytes a value and a byte a 64-column segment, where fp32 rows take 4)
        budget = PARTIAL_BYTES * 256 // 129 if partial16 else PARTIAL_BYTES
        # The previous chunk's fold in the main kernel (FOLD_IN_MAIN): two buffers of half
        # the budget, rows in the sorted layout
        fold_main = bool(FOLD_IN_MAIN and partial16 and not paired and trail is None and n_part <= 2
                         and getattr(main, "folds_in_main", lambda *a: False)(D, grad_out.shape[-1])
                         and not (PARTIAL_16_BF16 and getattr(main, "PARTIAL_BF16", False))
                         and not fold_runs(N, n_sm))
        chained = fold_main and bool(FOLD_CHAIN) and FOLD_IN_MAIN != "beside"
        n_bufs = 3 if chained else 2 if fold_main else 1
        chunk = chunk_tokens(T, n_part, k_stride, D, budget // n_bufs, n_sm)
        if topk_length is not None and n_part * k_stride * D * 4 >= LENGTH_ORDER_MIN_BYTES:
            tokens = length_order(topk_length, K)
        n_chunks = triton.cdiv(T, chunk)
        group = max(1, min(n_chunks, SORT_ENTRIES // max(1, chunk * K)))  # chunks a sort
        side = beside_stream(dev) if SORT_BESIDE else None
        invert = _Inverter(indices, topk_length, tokens, T, chunk, K, N, side, ranks=fold_main)
        inv = invert(0, min(group, n_chunks))
    if T > 0:
        dh = min(next_pow2(H), max(1, 8192 // d_v))
        _bwd_delta_kernel[(T, triton.cdiv(H, dh))](
            out, grad_out, grad_lse if grad_lse is not None else delta, delta, indices,
            trail if trail is not None else delta,
            H, N, K, out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1),
            grad_lse.stride(0) if grad_lse is not None else 0, indices.stride(0),
            D=d_v, BLOCK_H=dh, HAS_DLSE=grad_lse is not None, HAS_TRAIL=trail is not None, num_warps=4,
        )

    if topk_length is not None:
        main_options = dict(main_options, topk_length=topk_length)
    elif trail is not None:  # (the main kernel's only: no schedule, no sort keys change)
        main_options = dict(main_options, topk_length=trail, in_order=True)
    orders = None  # a main kernel with a ``schedule`` orders each chunk's tokens by length
    if getattr(main, "LAUNCH_CACHE", False):  # what its launches share over the call's chunks
        main_options = dict(main_options, cache={})

    def launch(p_begin, n_tok, partial, flags, **sorted_opts):
        # (positions [p_begin, p_begin + n_tok) of ``tokens``, or those tokens without lengths)
        opts = dict(main_options, **sorted_opts)
        if tokens is not None:
            opts = dict(opts, tokens=tokens[p_begin:p_begin + n_tok])
        if orders is not None:
            opts = dict(opts, order=orders[p_begin:p_begin + n_tok])
        main.launch(q, kv, indices, grad_out, lse, delta, grad_q, acc, partial, flags, p_begin, n_tok, scale,
                    scale * LOG2E, paired, **opts)

    dq_jobs = []  # the one-launch modes' remainder dQ parts, summed by the epilogue
    persisting = persist_rows(acc, T) if T > 0 and not deterministic else None
    if T > 0 and one_launch:
        if exact:  # each kv row's grids, from a bound on its sum (exact_sums)
            codes = exact_sums.row_codes(q, kv, indices, grad_out, delta, scale, topk_length)
            main_options = dict(main_options, exact_codes=codes)
        if topk_length is not None and hasattr(main, "schedule"):
            orders = main.schedule(topk_length, T, H, paired, tokens)
        if getattr(main, "DEFERS_DQ_PARTS", False):
            main_options = dict(main_options, dq_parts=dq_jobs)
        with l2_policy.window(persisting):
            launch(0, T, None, counters[4:] if n_main_flags else None)
    elif chunked:
        if topk_length is not None and hasattr(main, "schedule"):
            orders = main.schedule(topk_length, chunk, H, paired, tokens)
        rope = grad_out.shape[-1] != D  # (its last 64 columns: two segments of 32)
        bf16 = partial16 and PARTIAL_16_BF16 and getattr(main, "PARTIAL_BF16", False) and not rope
        if fold_main:  # two buffers (chained: three): chunk c's rows while chunk c - 1's are folded
            rows = (chunk * K + 1) * n_part
            sorted_bufs = [(torch.empty((rows, D), device=dev, dtype=torch.float16),
                            torch.empty((rows, ), device=dev, dtype=torch.int64)) for _ in range(n_bufs)]
            # (chained: each chunk's stores and fold ends, counted; the programs of each launch)
            sync = torch.zeros((2 * (n_chunks + 3), ), dtype=torch.int32, device=dev) if chained else None
            grids = []
        else:
            dtype = torch.bfloat16 if bf16 else torch.float16 if partial16 else torch.float32
            partial = torch.empty((chunk, n_part, k_stride, D), device=dev, dtype=dtype)
        fold16 = {}  # (the fold's arguments for 16-bit rows: their scales)
        if fold_main:
            fold16 = dict(P16=1, SORTED=True)
        elif partial16:
            # (each row's segment scales as biased exponent bytes, in int64 words: one load a row;
            # bf16 rows have none: one word a row, unused)
            partial_exp = torch.empty((chunk, n_part, k_stride, 1 if bf16 else scale_words(D, rope)),
                                      dtype=torch.int64, device=dev)
            main_options = dict(main_options, partial_exp=partial_exp)
            fold16 = dict(EXP=partial_exp, P16=3 if bf16 else 2 if rope else 1)
        n_flags = main.flags_per_chunk(chunk, n_hb)
        rows_per_program, unroll, fold_warps = fold_tile(N, n_sm, n_part)
        block_d = fold_block_d(D, rows_per_program)
        runs = fold_runs(N, n_sm)
        runs_unroll, runs_warps, runs_per_sm, runs_preload = FOLD_RUNS_CONFIG

        def fold_by_rows(part, order_c, seg_c, **rows16):  # (a chunk's fold by rows)
            _dkv_reduce_kernel[(triton.cdiv(N, rows_per_program), triton.cdiv(D, block_d))](
                part, order_c, seg_c, acc, K, k_stride, N,
                D=D, BLOCK_D=block_d, N_HB=n_part, MASK_D=D % block_d != 0, ROWS=rows_per_program,
                UNROLL=unroll, REVERSED=FOLD_ROWS_REVERSED, num_warps=fold_warps, **fold16, **rows16,
            )

        def fold_sorted(rows):  # a chunk's rows in the sorted layout (FOLD_IN_MAIN; no ORDER read)
            part, pexp, _, seg_c = rows
            fold_by_rows(part, seg_c, seg_c, EXP=pexp)
        beside = fold_main and FOLD_IN_MAIN == "beside"  # (the measurement arms: see FOLD_IN_MAIN)
        nofold = fold_main and FOLD_IN_MAIN == "nofold"
        runs_grid = max(1, n_sm) * runs_per_sm
        prev = None  # (FOLD_IN_MAIN: the previous chunk's rows, scales, sorted ids and segments)
        for c0 in range(0, n_chunks, group):
            g = min(group, n_chunks - c0)
            # These chunks' ids inverted (``_Inverter``): each chunk's entries sorted by kv
            # row, every kv row adding its entries in the order of (position, slot),
            # whatever the chunks.
            sorted_ids, order, seg, *ranks = invert.wait(inv)
            flags = torch.zeros((g, n_flags), dtype=torch.int32, device=dev) if n_flags else None
            for c in range(g):
                t0 = (c0 + c) * chunk
                n_tok = min(chunk, T - t0)
                if fold_main:
                    ci = c0 + c
                    part, pexp = sorted_bufs[ci % n_bufs]
                    opts = {}
                    if chained:
                        # (the kernel module's own program count; no GPU: a program a tile)
                        grids.append(main.program_count(n_tok * n_hb, dev, paired) if n_sm else n_tok * n_hb)
                        # (launch k + 1 folds chunk k, with its grids[k + 1] programs)
                        need_f2 = grids[ci - 1] if not nofold and ci >= 2 else 0
                        need_f3 = grids[ci - 2] if not nofold and ci >= 3 else 0
                        # (a group's first launch follows the inversion's wait and this call's
                        # other work in stream order; the others start early)
                        opts = dict(programs=grids[ci], chain=(sync, ci, 2 * grids[ci - 1] if ci >= 1 else 0,
                                                               need_f2, need_f3, c > 0))
                    launch(t0, n_tok, part, flags[c] if flags is not None else None, partial_exp=pexp,
                           ranks=ranks[0][c], fold=None if beside or nofold else prev, **opts)
                    prev = None if nofold else (part, pexp, sorted_ids[c], seg[c])
                else:
                    launch(t0, n_tok, partial, flags[c] if flags is not None else None)
                if c == g - 1 and c0 + group < n_chunks:  # the next group's, beside this fold
                    inv = invert(c0 + group, min(group, n_chunks - c0 - group))
                if fold_main:  # (the last chunk's rows: folded alone, below)
                    if beside:
                        fold_sorted(prev)
                        prev = None
                    continue
                if runs:
                    _dkv_fold_runs_kernel[(runs_grid,)](
                        partial, order[c], sorted_ids[c], seg[c], acc, K, k_stride, N,
                        D=D, BLOCK_D=next_pow2(D), N_HB=n_part, UNROLL=runs_unroll, PRELOAD=runs_preload,
                        num_warps=runs_warps, **fold16)
                    continue
                fold_by_rows(partial, order[c], seg[c])
        if fold_main and prev is not None:  # the last chunk's fold, alone
            fold_sorted(prev)

    # (the epilogue reads every accumulator row: its window gives the persisting lines back)
    with l2_policy.window(persisting, persist=False):
        grad_kv, grad_sink = epilogue(acc, kv.dtype, main.ACC_FAKE_ORDER, attn_sink, lse, delta, counters[:1],
                                      dq_jobs[0] if dq_jobs else None, two_words=exact)
    return grad_q, grad_kv, grad_sink


class _Inverter:
    """The deterministic path's id inversions, a group of chunks at a time: the chunks'
    (position, slot) entries keyed by kv row (``_sort_keys_kernel``: N for the entries that
    add nothing, slots past a length too, so they sort after every row), a stable sort of
    each chunk's keys (a fixed order) and each row's segment of the sorted entries. The
    outputs and the keys are allocated on the caller's stream; with a ``side`` stream the
    work runs there, after the caller's work enqueued so far, and ``wait`` makes the
    caller's stream wait for it before the outputs are used. The caller's allocator sees
    only its own stream, so every such tensor the side stream uses (the keys too) must stay
    alive until that wait: freed before it, its memory could go to the caller's next
    allocation while the side stream still reads it."""

    def __init__(self, indices, topk_length, tokens, T, chunk, K, N, side, ranks=False):
        self.indices, self.topk_length, self.tokens, self.side = indices, topk_length, tokens, side
        self.T, self.chunk, self.K, self.N = T, chunk, K, N
        # (with ``ranks`` also each entry's rank plus one, the sorted layout's row: FOLD_IN_MAIN;
        # the values a chunk's ranks take, scattered through its sorted order)
        self.rank_values = (torch.arange(1, chunk * K + 1, device=indices.device, dtype=torch.int32)
                            if ranks else None)
        # Sort keys as narrow as N allows: the radix sort makes one pass per key byte
        # (int64 keys: 8 passes, int16: 2).
        self.key_dtype = torch.int16 if N < 2**15 - 1 else torch.int32 if N < 2**31 - 1 else torch.int64
        self.rows = torch.arange(N + 1, device=indices.device, dtype=self.key_dtype)

    def __call__(self, c0: int, g: int):
        """Start inverting chunks c0 .. c0 + g - 1: a handle for ``wait``, which holds the
        keys too (see the class)."""
        dev, K, N, chunk = self.indices.device, self.K, self.N, self.chunk
        t_lo, n = c0 * chunk, g * chunk * K
        keys = torch.empty((g, chunk * K), dtype=self.key_dtype, device=dev)
        sorted_ids = torch.empty_like(keys)
        order = torch.empty((g, chunk * K), dtype=torch.int64, device=dev)
        seg = torch.empty((g, N + 1), dtype=torch.int64, device=dev)
        rank = None if self.rank_values is None else torch.empty_like(order, dtype=torch.int32)
        lengths = self.topk_length if self.topk_length is not None else self.indices
        with _on_stream(self.side):
            if n:
                _sort_keys_kernel[(triton.cdiv(n, 1024),)](
                    self.indices, lengths, self.tokens if self.tokens is not None else lengths, keys, t_lo,
                    min(self.T, t_lo + g * chunk) - t_lo, K, self.indices.stride(0), N, n,
                    HAS_TOK=self.tokens is not None, HAS_LEN=self.topk_length is not None, BLOCK=1024,
                    num_warps=4)
            torch.sort(keys, dim=-1, stable=True, out=(sorted_ids, order))
            torch.searchsorted(sorted_ids, self.rows.expand(g, N + 1).contiguous(), out=seg)
            if rank is not None:  # rank[order[e]] = e + 1 (row 0 of each part: the stores past K)
                rank.scatter_(1, order, self.rank_values.expand(g, chunk * K))
        return (keys, sorted_ids, order, seg) + ((rank, ) if rank is not None else ())

    def wait(self, inv):
        """(sorted_ids, order, seg), each [g, ...], of handle ``inv`` (and the ranks, with
        ``ranks``), once the caller's stream has waited for their work (keep ``inv`` until
        then)."""
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
        return inv[1:]


@contextlib.contextmanager
def _on_stream(stream):
    """``with _on_stream(s)``: the work enqueued in the block runs on stream ``s`` after the
    current stream's work so far (None: on the current stream)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


_BESIDE = {}


def beside_stream(dev: torch.device):
    """The device's second stream for the work beside the backward's main stream (one a
    device, made once), or None off CUDA."""
    if dev.type != "cuda":
        return None
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _BESIDE:
        _BESIDE[i] = torch.cuda.Stream(device=i)
    return _BESIDE[i]


def persist_rows(acc: torch.Tensor, T: int, l2: int | None = None) -> torch.Tensor | None:
    """The accumulator rows the fast mode's main launch keeps in the L2's persisting set-aside
    (None: none): where the accumulator is at least L2_PERSIST_MIN_L2 times the L2 (if set),
    the rows from T on (with DeepSeek-V4's ids the compressed pool after the T raw rows:
    selected at random over the whole call, while a raw row is selected by a sliding window
    of consecutive tokens, which the L2 keeps unaided), or all of them where N <= T. ``l2``:
    the L2's bytes (default: acc's GPU's; a CPU accumulator has none)."""
    if l2 is None:
        l2 = getattr(cuda_properties(acc.device), "L2_cache_size", 0) if acc.is_cuda else 0
    if L2_PERSIST_MIN_L2 is None or l2 <= 0 or acc.numel() * acc.element_size() < L2_PERSIST_MIN_L2 * l2:
        return None
    return acc[T:] if acc.shape[0] > T else acc


def length_order(topk_length: torch.Tensor, K: int) -> torch.Tensor:
    """int32 [T]: the tokens longest first (by their length clamped to [0, K]; ties in token
    order, so equal lengths keep the token order). The chunks of the deterministic mode
    take the tokens in this order where a token's partial rows are large
    (``LENGTH_ORDER_MIN_BYTES``): in token order a short chunk of random lengths waits for
    its longest tokens (H64 K2048: one token a program in a 132-token chunk, 0.79 of the
    full-K time with lengths uniform in [128, K]). The partial rows and the fold follow the
    positions in this order, so the bits do not depend on the chunking (the order is a
    function of the lengths alone)."""
    return torch.argsort(topk_length.clamp(0, K), descending=True, stable=True).to(torch.int32)


SINK_SEG_T = 256  # rows a program of grad_sink's parts


def zeroed_accumulator(N: int, D: int, n_flags: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 [N, D] accumulator and ``n_flags`` int32 counters after it (16-byte aligned,
    as the kernels are specialised for), zeros, in one allocation: one memset a call."""
    n_acc = triton.cdiv(N * D, 4) * 4
    buf = torch.zeros(n_acc + n_flags, dtype=torch.float32, device=device)
    return buf[:N * D].view(N, D), buf[n_acc:].view(torch.int32)


def epilogue(acc, kv_dtype, fake_order: bool, attn_sink, lse, delta, ticket,
             dq_parts: DqParts | None = None, two_words: bool = False):
    """grad_kv (``acc`` [N, D] fp32 in kv's dtype, undoing the fake column order) and
    grad_sink ([H] fp32 = -sum_t exp(sink - lse) * Delta by segments of ``SINK_SEG_T`` rows,
    then their sum in segment order: the same bits for a given T; empty without a sink), in
    one launch, with ``dq_parts`` summed into their grad_q rows. ``ticket``: an int32 zero
    the launch counts its sink programs on. ``two_words``: ``acc`` is [N, 2 D], each row's
    hi words then its lo words (exact_sums), and grad_kv their sum."""
    N, D = acc.shape
    D //= 1 + two_words
    T, H = delta.shape
    dev = acc.device
    grad_kv = torch.empty((N, D), dtype=kv_dtype, device=dev)
    block_c = D if D & (D - 1) == 0 else math.gcd(D, 256)  # power-of-two widths in one piece
    block_n = max(1, 4096 // block_c)
    n_conv = triton.cdiv(N, block_n) * (D // block_c) if N > 0 else 0
    has_sink = attn_sink is not None
    n_seg = triton.cdiv(T, SINK_SEG_T) if has_sink and H > 0 else 0
    block_h = min(16, next_pow2(H))
    sum_h = min(128, next_pow2(H))
    if not has_sink:
        grad_sink = torch.empty((0,), dtype=torch.float32, device=dev)
    elif n_seg == 0:  # T = 0 (no parts, no program writes it) or H = 0
        grad_sink = torch.zeros((H,), dtype=torch.float32, device=dev)
    else:
        grad_sink = torch.empty((H,), dtype=torch.float32, device=dev)
    part = torch.empty((n_seg, H), dtype=torch.float32, device=dev) if n_seg else acc
    n_dq = dq_parts.n_rem * dq_parts.bh if dq_parts is not None else 0
    if n_dq and (tuple(dq_parts.grad_q.shape[2:]) != (D,) or D & (D - 1)):
        raise ValueError(f"dq_parts: grad_q's last dim must be the accumulator's {D}, a power of two "
                         f"(the parts exist at D = 512), got {tuple(dq_parts.grad_q.shape)}")
    n_prog = n_conv + n_dq + n_seg * triton.cdiv(H, block_h)
    if n_prog:
        # (the pointers of a part without programs are never read: the accumulator stands in)
        sink_args = (attn_sink, lse, delta, part, grad_sink) if n_seg else (acc,) * 5
        if n_dq:
            j = dq_parts
            dq_args = (j.dqf, j.grad_q, n_dq, j.t_begin, j.n_full, j.n_parts, j.n_hb, j.grad_q.stride(0),
                       j.grad_q.stride(1))
        else:
            dq_args = (acc, acc, 0, 0, 0, 1, 1, 0, 0)
        _epilogue_kernel[(n_prog,)](
            acc, grad_kv, N, n_conv, *sink_args, ticket, T, H, lse.stride(0) if n_seg else 0, n_seg, *dq_args,
            D=D, BLOCK_N=block_n, BLOCK_C=block_c, FAKE_ORDER=fake_order, HAS_SINK=n_seg > 0,
            SEG_T=SINK_SEG_T, BLOCK_H=block_h, SUM_SEG=max(1, 4096 // sum_h), SUM_H=sum_h,
            HAS_DQ=n_dq > 0, DQ_BH=dq_parts.bh if n_dq else 64, TWO_WORDS=two_words, num_warps=4)
    return grad_kv, grad_sink
