"""Probe for a fold inside the deterministic main kernel: how fast one warp group an SM, with
few registers (32 a thread; in the main kernel the producer would fold, with 56 less its
own), folds a chunk's 16-bit partial rows when its entries' rows come into shared memory by
``cp.async`` (no registers held for the bytes in flight) rather than by plain loads.

The probe kernel (``fold_kernel``, one warp group a program, ``maxnreg`` 32) folds
the kv rows N - 1 - pid, N - 1 - pid - G, ... (the shipped fold's longest-first order) of one
chunk: per row, blocks of P entries whose positions and scale words go to shared memory,
then tiles of E entries' rows copied by ``cp.async`` into a ring of STAGES tiles, each
entry added in the sorted order into four fp32 values a thread. It must give the shipped
fold's bits (``backward._dkv_reduce_kernel``), which the script checks before it times.

    PYTHONPATH=src:tests:benchmarks:benchmarks/experiments \\
        python benchmarks/experiments/fold_wg_probe_bench.py > fold_wg_probe.jsonl

One JSON line per (grid, E, STAGES): the fold's time (do_bench median), GB/s of partial rows
read in all and an SM, registers and spill of the build, and whether the bits match; first
the shipped fold alone on the same chunk. The docs' design note
(docs/performance/backward.md#open-leads, item 2) says what rate an SM the design needs.
"""
import json
import os

import torch
import triton
import triton.testing
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy as _cp

from bench import make_inputs
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels.fold_gluon import _view
from dsv4_sparse_attn.kernels.hopper import async_load, thread_barrier

# (unswizzled, row-major: a view of another rank is the same bytes; a view's layout has
# its shape's rank or one less, so each buffer is also seen with a 1-D layout to take
# single rows out of it; ``_view`` is the fold in the main kernel's)
_FLAT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
_FLAT1 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def fold_smem(D: gl.constexpr, E: gl.constexpr, STAGES: gl.constexpr, P: gl.constexpr):
    """``fold_rows``' shared memory: the ring of tiles, a block's positions and scale
    words (D = 512, E = 8, STAGES = 2, P = 128: 17.9 KB)."""
    buf = gl.allocate_shared_memory(gl.float16, [STAGES, E, D], _FLAT)
    pos_s = gl.allocate_shared_memory(gl.int32, [P // E, E], _FLAT1)
    w_s = gl.allocate_shared_memory(gl.int64, [P, 1], _FLAT1)
    return buf, pos_s, w_s


@gluon.jit
def _issue(buf, pos_s, PART, slot, k0, n_b, D: gl.constexpr, E: gl.constexpr, P: gl.constexpr,
           cp_l: gl.constexpr):
    """cp.async of the block's entries k0 .. k0 + E - 1 (the partial rows at the
    positions in ``pos_s``; zeros past ``n_b``, a whole tile of zeros past the block)
    into tile ``slot`` of ``buf``."""
    e = gl.arange(0, E, layout=gl.SliceLayout(1, cp_l))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, cp_l))
    ok = (k0 + e) < n_b
    pos = pos_s.index(gl.minimum(k0 // E, P // E - 1)).load(gl.SliceLayout(1, cp_l))
    async_load(buf.index(slot), PART + pos.to(gl.int64)[:, None] * D + c[None, :], mask=ok[:, None])


@gluon.jit
def fold_rows(PART, EXP, ORDER, SEG, ACC, N, first, step, buf, pos_s, w_s, D: gl.constexpr,
              E: gl.constexpr, STAGES: gl.constexpr, P: gl.constexpr):
    """acc[r] += the chunk's entries of row r, in order, for r = N - 1 - first, N - 1 -
    first - step, ... (one warp group; see the module). PART: fp16 rows [entries, D]
    (an entry's row is its flat (token-in-chunk, slot) position), EXP: an int64 scale
    word an entry (a biased exponent byte a 64-column segment)."""
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # [E, D]: 16-byte copies
    acc_l: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])  # [D]: 4 columns a thread
    pe_l: gl.constexpr = gl.BlockedLayout([1, 1], [32 // E, E], [4, 1], [1, 0])  # [P // E, E]
    pw_l: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [1, 0])  # [P, 1]
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    rows_s = _view(buf, gl.float16, STAGES * E, D, _FLAT1)  # (the tiles, a row at a time)
    cols = gl.arange(0, D, layout=acc_l)
    seg = cols // 64
    sh = (seg % 4) * 8
    hi_sel = (seg // 4) % 2 == 1
    k2 = (gl.arange(0, P // E, layout=gl.SliceLayout(1, pe_l))[:, None] * E
          + gl.arange(0, E, layout=gl.SliceLayout(0, pe_l))[None, :])
    kw = gl.arange(0, P, layout=gl.SliceLayout(1, pw_l))[:, None]
    t_all = 0  # tiles issued so far (a tile's slot in the ring)
    for i in range(first, N, step):
        r = N - 1 - i
        start = gl.load(SEG + r)
        end = gl.load(SEG + r + 1)
        if end > start:
            acc = gl.load(ACC + r * D + cols)
            for b0 in range(start, end, P):
                n_b = gl.minimum(end - b0, P).to(gl.int32)  # (int32: shared-memory indices)
                ent2 = gl.load(ORDER + b0 + k2, mask=k2 < n_b, other=0)
                entw = gl.load(ORDER + b0 + kw, mask=kw < n_b, other=0)
                w = gl.load(EXP + entw, mask=kw < n_b, other=0)
                thread_barrier()  # (the previous block's tiles and words are read)
                _view(pos_s, gl.int32, P // E, E, _FLAT).store(ent2.to(gl.int32))
                _view(w_s, gl.int64, P, 1, _FLAT).store(w)
                thread_barrier()
                n_t = gl.cdiv(n_b, E)
                for s in gl.static_range(STAGES - 1):
                    _issue(buf, pos_s, PART, (t_all + s) % STAGES, s * E, n_b, D, E, P, cp_l)
                    _cp.commit_group()
                for t in range(n_t):
                    nxt = t + STAGES - 1  # (past the block's entries: a tile of zeros, never read)
                    _issue(buf, pos_s, PART, (t_all + nxt) % STAGES, nxt * E, n_b, D, E, P, cp_l)
                    _cp.commit_group()
                    _cp.wait_group(STAGES - 1)
                    thread_barrier()
                    r0 = ((t_all + t) % STAGES) * E
                    for j in gl.static_range(E):
                        x = rows_s.index(r0 + j).load(acc_l).to(gl.float32)
                        wv = gl.max(w_s.index(t * E + j).load(one_l), 0)
                        half = gl.where(hi_sel, (wv >> 32).to(gl.int32), wv.to(gl.int32))
                        acc += x * (((half >> sh) & 0xFF) << 23).to(gl.float32, bitcast=True)
                    thread_barrier()  # (the tile's slot is written again STAGES - 1 tiles on)
                t_all += n_t + STAGES - 1
                _cp.wait_group(0)
            gl.store(ACC + r * D + cols, acc)


@gluon.jit
def fold_kernel(PART, EXP, ORDER, SEG, ACC, N, D: gl.constexpr, E: gl.constexpr, STAGES: gl.constexpr,
                P: gl.constexpr):
    """``fold_rows`` alone, one warp group a program (the probe's kernel)."""
    buf, pos_s, w_s = fold_smem(D, E, STAGES, P)
    fold_rows(PART, EXP, ORDER, SEG, ACC, N, gl.program_id(0), gl.num_programs(0), buf, pos_s, w_s,
              D, E, STAGES, P)


def main():
    dev = "cuda"
    T, K, D = int(os.environ.get("T", 4096)), int(os.environ.get("K", 640)), 512
    _, kv, idx, _ = make_inputs(T, 1, K, D, dev=dev)
    N = kv.shape[0]
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    chunk = kbwd.chunk_tokens(T, 1, K, D, kbwd.PARTIAL_BYTES * 256 // 129, n_sm)
    g = torch.Generator(device=dev).manual_seed(0)
    part = torch.randn((chunk, 1, K, D), device=dev, generator=g).to(torch.float16)
    # (each row's scale word: a biased exponent byte a segment, scales 2^-7 .. 2^7)
    exp = torch.randint(120, 135, (chunk * K, 8), device=dev, dtype=torch.uint8, generator=g)
    exp = exp.view(torch.int64)
    inv = kbwd._Inverter(idx, None, None, T, chunk, K, N, None)
    _, order, seg = inv.wait(inv(0, 1))
    order, seg = order[0].contiguous(), seg[0].contiguous()
    acc0 = torch.randn((N, D), device=dev, generator=g)
    ref = acc0.clone()

    def shipped(a):
        kbwd._dkv_reduce_kernel[(N, 1)](part, order, seg, a, K, K, N, D=D, BLOCK_D=512, N_HB=1, MASK_D=False,
                                        ROWS=1, UNROLL=8, EXP=exp, P16=1, REVERSED=True, num_warps=4)
    shipped(ref)
    gb = chunk * K * D * 2 / 1e9
    work = acc0.clone()
    ms = triton.testing.do_bench(lambda: shipped(work), warmup=10, rep=100)
    print(json.dumps(dict(arm="shipped", T=T, K=K, chunk=chunk, ms=round(ms, 4), gbps=round(gb / ms * 1e3, 1),
                          gbps_sm=round(gb / ms * 1e3 / n_sm, 2))), flush=True)
    maxnreg = int(os.environ.get("MAXNREG", 32))

    def probe(grid, a, E, stages):
        return fold_kernel[(grid,)](part, exp, order, seg, a, N, D=D, E=E, STAGES=stages, P=128,
                                    num_warps=4, maxnreg=maxnreg)
    for grid in (n_sm, n_sm // 2, n_sm // 4):
        for E, stages in ((8, 2), (8, 3), (16, 2), (4, 4)):
            try:
                a = acc0.clone()
                k = probe(grid, a, E, stages)
                same = torch.equal(a, ref)
                ms = triton.testing.do_bench(lambda: probe(grid, work, E, stages), warmup=10, rep=100)
                row = dict(arm="wg", grid=grid, E=E, stages=stages, bitwise=same, ms=round(ms, 4),
                           gbps=round(gb / ms * 1e3, 1), gbps_sm=round(gb / ms * 1e3 / grid, 2),
                           registers=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None))
                if not same:
                    row["max_abs_diff"] = (a - ref).abs().max().item()
            except Exception as e:  # (a build that fails: reported, the others still run)
                row = dict(arm="wg", grid=grid, E=E, stages=stages, error=f"{type(e).__name__}: {e}"[:300])
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
