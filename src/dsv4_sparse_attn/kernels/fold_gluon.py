"""The deterministic mode's fold inside the Gluon main kernel (``backward.FOLD_IN_MAIN``):
the producer warp group of chunk c's main kernel folds chunk c - 1's 16-bit partial rows
into the fp32 accumulator between its gathers (docs/performance/backward.md#open-leads,
item 2). The fold alone is bound by the HBM and the main kernel by its consumers' chains,
so on the same SMs they overlap.

Chunk c - 1's rows were stored in sorted order (``SORTED`` main kernels: each (token, slot)
entry's row at its rank in the chunk's (kv row, position, slot) order, plus one: row 0 of
each part takes the stores of slots past K), so a kv row's entries are consecutive rows of
the buffer and a program's share of the fold is one contiguous range: the entries of the
kv rows whose first entry falls in [rank, rank + 1) x entries / programs. Its rows come by
cp.async, E entries (E x NP rows of 512 fp16) a tile, into a ring of S tiles; each entry's
NP head-block parts are scaled and added in part order, then added to the row's sum: the
arithmetic and order of ``backward._dkv_reduce_kernel``, so the bits are the shipped fold's
whatever the chunks.

The state carried through the producer's loops (``FoldState``): the next tile, the current
kv row (its end and four fp32 values a thread), and the next row (its id, end and values,
loaded a tile ahead so that a row change waits on no load).
"""
from __future__ import annotations

from .hopper import gl, gluon

if gl is not None:
    from triton.experimental.gluon.language.nvidia.hopper import async_copy as _cp

    from .hopper import async_load, thread_barrier

    _D = gl.constexpr(512)  # value columns of a partial row (the Gluon kernel's D)
    # (unswizzled, row-major: a view of another shape is the same bytes; a view's layout has
    # its shape's rank or one less)
    _FLAT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    _FLAT1 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # (a later Triton renamed the descriptors' ``_reinterpret`` to ``reinterpret``)
    _NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
    # the producer warp group's layouts: a row's 512 columns as [128, 4], thread t holding
    # columns 4t .. 4t + 3 (one 64-column segment, so one scale a thread: [128] in
    # SliceLayout(1, _ROW_L)); one value a thread (a word's broadcast); a tile's rows by
    # 16-byte copies
    _ROW_L = gl.constexpr(gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0]))
    _ONE_L = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
    _CP_L = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))

    @gluon.jit
    def _view(mem, dtype: gl.constexpr, rows: gl.constexpr, cols: gl.constexpr, layout: gl.constexpr):
        """``mem`` seen as [rows, cols] of ``dtype`` with ``layout`` (the same bytes)."""
        if _NEW_REINTERPRET:
            return mem.reinterpret(dtype, [rows, cols], layout)
        else:
            return mem._reinterpret(dtype, [rows, cols], layout)

    @gluon.jit
    def _view3(mem, dtype: gl.constexpr, a: gl.constexpr, b: gl.constexpr, c: gl.constexpr,
               layout: gl.constexpr):
        """``mem`` seen as [a, b, c] of ``dtype`` with ``layout`` (the same bytes)."""
        if _NEW_REINTERPRET:
            return mem.reinterpret(dtype, [a, b, c], layout)
        else:
            return mem._reinterpret(dtype, [a, b, c], layout)

    @gluon.jit
    def _cols():
        """A row's columns in ``_ROW_L``: [128, 4]."""
        return (gl.arange(0, _D // 4, layout=gl.SliceLayout(1, _ROW_L))[:, None] * 4
                + gl.arange(0, 4, layout=gl.SliceLayout(0, _ROW_L))[None, :])

    @gluon.jit
    def fold_smem(E: gl.constexpr, S: gl.constexpr, NP: gl.constexpr):
        """The ring: S tiles of E entries' NP rows, and their scale words (E = 8, S = 2, NP = 1:
        16.1 KB); the words' shape [S, NP, E] carries NP and E to the producer, which sees them
        as [S, E NP]."""
        buf = gl.allocate_shared_memory(gl.float16, [S, E * NP, _D], _FLAT)
        words = gl.allocate_shared_memory(gl.int64, [S, NP, E], _FLAT)
        return buf, words

    @gluon.jit
    def _row_start(SID, SEG, x, n_valid):
        """The first entry >= x that starts a kv row (n_valid past the last)."""
        xc = gl.minimum(x, gl.maximum(n_valid - 1, 0))
        r = gl.load(SID + xc).to(gl.int32)
        s = gl.load(SEG + r).to(gl.int32)
        nxt = gl.load(SEG + r + 1).to(gl.int32)
        return gl.where(x >= n_valid, n_valid, gl.where(s == x, x, nxt))

    @gluon.jit
    def _prefetch_l2(PART, e0, e1, t, E: gl.constexpr, NP: gl.constexpr):
        """Tile t's rows (E NP KB, contiguous) into the L2 (``prefetch.global.L2``: no register
        or shared memory holds them), so that its cp.async later reads the L2, not the HBM: each
        thread one 64-byte piece, none past e1's rows."""
        first = e0 + t * E
        if first < e1:
            k = gl.arange(0, 128, layout=_ONE_L)
            row0 = (first + 1).to(gl.int64) * NP
            last = (e1 + 1).to(gl.int64) * NP * _D - 32  # (the last piece of the last row)
            off = gl.minimum(row0 * _D + k * (E * NP * 4), last)
            gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [PART + off],
                                      dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _issue(buf, words, PART, EXP, e0, e1, t, E: gl.constexpr, S: gl.constexpr, NP: gl.constexpr):
        """cp.async of tile t (entries e0 + t E ..., at most e1) into its ring slot; zeros past
        e1 (nothing past the program's tiles). Then one commit (an empty group past them)."""
        first = e0 + t * E
        if first < e1:
            r = gl.arange(0, E * NP, layout=gl.SliceLayout(1, _CP_L))
            c = gl.arange(0, _D, layout=gl.SliceLayout(0, _CP_L))
            ok = r < (e1 - first) * NP
            row0 = (first + 1).to(gl.int64) * NP  # (row 0 of each part: the stores past K)
            slot = t % S
            async_load(buf.index(slot), PART + (row0 + r)[:, None] * _D + c[None, :], mask=ok[:, None],
                       cache_modifier=".cg")
            k = gl.arange(0, E * NP, layout=_ONE_L)
            async_load(words.index(slot), EXP + row0 + k, mask=k < (e1 - first) * NP)
        _cp.commit_group()

    @gluon.jit
    def _part(buf, words, slot, i, sh, E: gl.constexpr, S: gl.constexpr, NP: gl.constexpr):
        """Row i of ring slot ``slot`` times its segments' scales (``backward._scaled``: the
        value is exact in fp32); ``sh``: the bit offset of each thread's segment byte."""
        rows = _view3(buf, gl.float16, S * E * NP, _D // 4, 4, _FLAT)
        w_all = _view(words, gl.int64, S * E * NP, 1, _FLAT1)
        x = rows.index(slot * (E * NP) + i).load(_ROW_L).to(gl.float32)
        w = gl.max(w_all.index(slot * (E * NP) + i).load(_ONE_L), 0)
        e = ((w >> sh) & 0xFF).to(gl.int32)
        return x * (e << 23).to(gl.float32, bitcast=True)[:, None]

    @gluon.jit
    def _row_ahead(SEG, ACC, r, cols):
        """Row r's end (a [1] tensor, reduced only when the row starts: as a scalar it went to a
        uniform register at once, which waited for the load there) and its sum so far."""
        end = gl.load(SEG + r + 1 + gl.zeros([1], gl.int32, _ONE_L)).to(gl.int32)
        return end, gl.load(ACC + r.to(gl.int64) * _D + cols, cache_modifier=".cg")

    @gluon.jit
    def fold_begin(FSID, FSEG, ACC, N, rank, grid, ahead, buf, words, FP, FE, E: gl.constexpr,
                   S: gl.constexpr, NP: gl.constexpr, START: gl.constexpr = True):
        """This program's share of the fold (entries [e0, e1)), its first row loaded and the
        ring's first S - 1 tiles issued: the state ``fold_tiles`` carries. ``START`` False
        (the chained launches, ``backward.FOLD_CHAIN``): the share and its rows' ids only
        (the sorted ids and segments are there before the launch); the row's sum and the
        tiles wait for ``fold_start``, once the previous chunks are ready."""
        n_valid = gl.load(FSEG + N).to(gl.int32)
        lo = ((rank.to(gl.int64) * n_valid) // grid).to(gl.int32)
        hi = (((rank + 1).to(gl.int64) * n_valid) // grid).to(gl.int32)
        e0 = _row_start(FSID, FSEG, lo, n_valid)
        e1 = _row_start(FSID, FSEG, hi, n_valid)
        live = e0 < e1
        last = gl.maximum(n_valid - 1, 0)
        rc = gl.load(FSID + gl.minimum(e0, last), mask=live, other=0).to(gl.int32)
        endc = gl.load(FSEG + rc + 1, mask=live, other=0).to(gl.int32)
        # the next row (where e0's ends), its end and values loaded at the first tile
        rn = gl.load(FSID + gl.minimum(endc, last), mask=endc < e1, other=0).to(gl.int32)
        endn = gl.full([1], 0, gl.int32, _ONE_L)
        acc = gl.zeros([_D // 4, 4], gl.float32, _ROW_L)
        # (the tile and pending flag as tensors: a state made in a branch merges with the loop's)
        state = (e0 * 0, e0, e1, rc, endc, acc, rn, endn, acc, e0 * 0 + 1)
        if START:
            state = fold_start(state, ACC, ahead, buf, words, FP, FE, E, S, NP)
        return state

    @gluon.jit
    def fold_start(state, ACC, ahead, buf, words, FP, FE, E: gl.constexpr, S: gl.constexpr,
                   NP: gl.constexpr):
        """The fold's first row's sum so far loaded and the ring's first S - 1 tiles issued
        (and ``ahead`` more prefetched into the L2)."""
        t, e0, e1, rc, endc, acc, rn, endn, accn, pending = state
        cols = _cols()
        acc = gl.load(ACC + rc.to(gl.int64) * _D + cols, mask=(e0 < e1) & (cols >= 0), other=0.0,
                      cache_modifier=".cg")
        for i in gl.static_range(S - 1):
            _issue(buf, words, FP, FE, e0, e1, i, E, S, NP)
        if ahead > 0:  # (the tiles up to S - 1 + ahead into the L2: the first tile steps prefetch on)
            for tp in range(S - 1, S - 1 + ahead):
                _prefetch_l2(FP, e0, e1, tp, E, NP)
        return (t, e0, e1, rc, endc, acc, rn, endn, accn, pending)

    @gluon.jit
    def fold_tiles(state, count, ahead, FSID, FSEG, ACC, buf, words, FP, FE, E: gl.constexpr, S: gl.constexpr,
                   NP: gl.constexpr):
        """Up to ``count`` more tiles of the fold (none once its tiles are done); returns the
        state. A tile: the next one S - 1 ahead issued (and with ``ahead`` > 0 the one S - 1 +
        ``ahead`` on prefetched into the L2), this one waited for, then its entries added in
        order, each kv row's sum stored when its entries end."""
        t, e0, e1, rc, endc, acc, rn, endn, accn, pending = state
        cols = _cols()
        # (a thread's segment t / 16: its scale is that byte of the row's word)
        sh = (gl.arange(0, _D // 4, layout=gl.SliceLayout(1, _ROW_L)) // 16 * 8).to(gl.int64)
        n_t = gl.cdiv(e1 - e0, E)
        stop = gl.minimum(t + count, n_t)  # (count may exceed the tiles left: a while, not a range)
        while t < stop:
            _issue(buf, words, FP, FE, e0, e1, t + S - 1, E, S, NP)
            if ahead > 0:
                _prefetch_l2(FP, e0, e1, t + S - 1 + ahead, E, NP)
            if pending != 0:  # (rn came in a tile ago: its end and values now)
                endn, accn = _row_ahead(FSEG, ACC, rn, cols)
                pending = 0
            _cp.wait_group(S - 1)
            thread_barrier()  # (every thread's copies of tile t have landed)
            slot = t % S
            for j in gl.static_range(E):
                e = e0 + t * E + j
                if e < e1:
                    if e == endc:  # the row's entries end: its sum stored, the next row's taken
                        gl.store(ACC + rc.to(gl.int64) * _D + cols, acc)
                        if pending != 0:  # (two row changes within a tile)
                            endn, accn = _row_ahead(FSEG, ACC, rn, cols)
                        rc = rn
                        endc = gl.max(endn, 0)
                        acc = accn
                        rn = gl.load(FSID + endc, mask=endc < e1, other=0).to(gl.int32)
                        pending = 1
                    x = _part(buf, words, slot, j * NP, sh, E, S, NP)
                    for hb in gl.static_range(1, NP):
                        x += _part(buf, words, slot, j * NP + hb, sh, E, S, NP)
                    acc += x
            thread_barrier()  # (the slot is written again by the issue S - 1 tiles on)
            t += 1
            if t == n_t:  # the last row's sum
                gl.store(ACC + rc.to(gl.int64) * _D + cols, acc)
        return (t, e0, e1, rc, endc, acc, rn, endn, accn, pending)
