"""What the Gluon kernels for Hopper (sm_90) share: Gluon names that moved between Triton
releases, the id loader, the 16-byte dKV reductions, the register split of the
warp-specialised kernels, the wgmma buffer indices kept at their call sites under Triton 3.9
(``fresh``), and the question "can this machine run them at all".

Triton 3.6 to 3.9 are supported (docs/design.md#toolchain-notes): 3.7 renamed
``gl.thread_barrier`` to ``gl.barrier``; 3.8 renamed cp.async's
``async_copy_global_to_shared`` to ``async_load`` (3.9 removed the old name). The aliases
below pick whichever this Triton has, so the kernels are written once.
"""
from __future__ import annotations

import functools
import struct

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import tma as _tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _IMPORT_ERROR = None
except ImportError as e:  # a Triton without Gluon's Hopper API
    gluon = gl = _cp = _tma = TensorDescriptor = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

from .common import KERNEL_DTYPES, cuda_properties

# (major, minor) of the installed Triton: what some Gluon builds compile clean under
TRITON_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])

# Warp specialisation: 3 partitions of one warp group each, under a register limit of
# MAXNREG per thread at launch; setmaxnreg then gives each consumer warp group 232 and
# leaves 40 to the producer (3 x 168 = 40 + 232 + 232; 12 warps x 32 x 168 fit 64K).
NUM_WARPS = 4
MAXNREG = 168
CONSUMER_REGS = 232


# The PTX of ``red_f32x4_fake`` (one instance: 8 registers of a thread; see its docstring)
# and of ``st_f32x4_fake``, the same addressing with stores (plain, or streaming: ``.cs``).
def _fake_ptx(regs: str, lane_bytes: int, body: str) -> str:
    """One instance of the fake-order asm: declarations ``regs`` beside the predicates and
    offsets, the two rows' addresses (their group bases $8 and $10 plus ``lane_bytes`` x
    (lane % 4)) and their flags ($24, $26), then ``body``, then the dummy outputs."""
    return f"""{{
    .reg .pred p, p8;
    .reg .b32 {regs};
    .reg .b64 o, o8;
    setp.ne.b32 p, $24, 0;
    setp.ne.b32 p8, $26, 0;
    mov.u32 l, %laneid;
    and.b32 l, l, 3;
    mul.wide.u32 o, l, {lane_bytes};
    add.s64 o8, o, $10;
    add.s64 o, o, $8;
{body}
    mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
    mov.b32 $4, 0; mov.b32 $5, 0; mov.b32 $6, 0; mov.b32 $7, 0;
}}"""


_FAKE_PTX_SRC = _fake_ptx("l", 16, """    @p red.relaxed.gpu.global.add.v4.f32 [o], {$16, $17, $20, $21};
    @p8 red.relaxed.gpu.global.add.v4.f32 [o8], {$18, $19, $22, $23};""")
_FAKE_RED = "red.relaxed.gpu.global.add.v4.f32"
_ST_PTX_SRC = _FAKE_PTX_SRC.replace(_FAKE_RED, "st.global.v4.f32")
_ST_CS_PTX_SRC = _FAKE_PTX_SRC.replace(_FAKE_RED, "st.global.cs.v4.f32")
_FAKE_CONSTRAINTS_SRC = "=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,l,l,l,l,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r"
# ``st_f16x4_fake``: the same fake column order in rows of fp16 (8 bytes a lane's four
# values of a row's 16-column group), rounded by ``cvt.rn.f16x2.f32`` (its first source to
# the upper half: the higher address), stored streaming (each row is read once, by the fold).
_ST16_PTX_SRC = _fake_ptx("l, h0, h1, h2, h3", 8, """    cvt.rn.f16x2.f32 h0, $17, $16;
    cvt.rn.f16x2.f32 h1, $21, $20;
    cvt.rn.f16x2.f32 h2, $19, $18;
    cvt.rn.f16x2.f32 h3, $23, $22;
    @p st.global.cs.v2.b32 [o], {h0, h1};
    @p8 st.global.cs.v2.b32 [o8], {h2, h3};""")
# ``st_bf16x4_fake``: the same stores of bf16 values (no scale: bf16 has fp32's exponent range;
# a measurement option of the deterministic mode, ``backward.PARTIAL_16_BF16``)
_ST16_BF16_PTX_SRC = _ST16_PTX_SRC.replace("cvt.rn.f16x2.f32", "cvt.rn.bf16x2.f32")

# The PTX of ``red_f32x4_lines`` (one instance: 16 registers of a thread; see its docstring).
# tests/test_fake_column_order.py replays it for every lane. Its two halves (suffix x, then
# y) are the same code on operands two apart: bases $16/$24 and $18/$26, flags $48 and $50,
# values $32.. and $34.. (pairs of a thread's two rows, r and r + 8).


def _lines_half_decls(h: str, packed: bool = False, exact: bool = False) -> str:
    extra = (f"    .reg .b32 i{h}0, i{h}1, i{h}2, i{h}3, s{h}, xl{h}, xh{h};\n"
             f"    .reg .b64 d{h}0, d{h}1, x{h}, a{h};\n") if packed else ""
    if exact:
        extra += f"    .reg .b32 u{h}0, u{h}1, u{h}2, u{h}3, ch{h}, cl{h};\n    .reg .b64 bl{h};\n"
    return (f"    .reg .pred p{h};\n"
            f"    .reg .b32 lo{h}, hi{h}, on{h}, f{h};\n"
            f"    .reg .b32 v{h}0, v{h}1, v{h}2, v{h}3;\n"
            f"    .reg .b32 w{h}0, w{h}1, w{h}2, w{h}3;\n"
            f"    .reg .b64 bs{h}, br{h}, ba{h};\n" + extra)


# Two s32 words a 64-bit add (a timing prototype of an exact, order-independent dKV sum:
# docs/performance/backward.md#open-leads). ``b * 2^32 + a`` with a sign-extended sums
# both words exactly (the carries out of the low word are exact too), so each word's final
# sum is recovered if it fits in 32 bits. The values are scaled by PACKED_SCALE and rounded
# (a per-row grid in a real design). A lane's 16 bytes of a line are two such words; lanes
# l and l ^ 4 (the line's two 64-byte halves) swap one of them so that each of the two
# reductions of a row covers one whole 64-byte half: the even lane adds its own first word
# and then the odd lane's first, the odd lane the even lane's second and then its own.
PACKED_SCALE = 2.0 ** 20


def _f32_imm(x: float) -> str:
    """``x`` as a PTX f32 immediate (``0f`` and its eight hex digits)."""
    return f"0f{struct.unpack('>I', struct.pack('>f', x))[0]:08X}"


def _packed_reds(h: str, p: str, ba: str, w: list, convert: bool = True) -> list:
    """The reductions of one row's line as two s32 words a ``red.add.u64`` (see above).
    ``convert`` False: the fp32 bits themselves as the words (no scaling, rounding or sign
    fix-up; a timing arm that leaves the conversion's instructions out)."""
    if not convert:
        out = [f"    mov.b64 d{h}0, {{{w[0]}, {w[1]}}};", f"    mov.b64 d{h}1, {{{w[2]}, {w[3]}}};"]
    else:
        out = [f"    mul.rn.f32 i{h}{i}, {w[i]}, {_f32_imm(PACKED_SCALE)};" for i in range(4)]
        out += [f"    cvt.rni.s32.f32 i{h}{i}, i{h}{i};" for i in range(4)]
        for d, (a, b) in enumerate(((0, 1), (2, 3))):  # hi word less one where the low one is negative
            out += [f"    shr.s32 s{h}, i{h}{a}, 31;",
                    f"    add.s32 s{h}, i{h}{b}, s{h};",
                    f"    mov.b64 d{h}{d}, {{i{h}{a}, s{h}}};"]
    out += [f"    selp.b64 x{h}, d{h}0, d{h}1, odd;",  # the odd lane sends its first word
            f"    mov.b64 {{xl{h}, xh{h}}}, x{h};",
            f"    shfl.sync.bfly.b32 xl{h}, xl{h}, 4, 0x1f, 0xffffffff;",
            f"    shfl.sync.bfly.b32 xh{h}, xh{h}, 4, 0x1f, 0xffffffff;",
            f"    mov.b64 x{h}, {{xl{h}, xh{h}}};",
            # first half: even lane its own first word at its address, odd lane the even
            # lane's second word 64 - 8 bytes before its own address
            f"    add.s64 a{h}, {ba}, -56;",
            f"    selp.b64 a{h}, a{h}, {ba}, odd;",
            f"    selp.b64 d{h}0, x{h}, d{h}0, odd;",
            f"    @{p} red.relaxed.gpu.global.add.u64 [a{h}], d{h}0;",
            # second half: even lane the odd lane's first word 64 bytes on, odd lane its own
            # second word 8 bytes on
            f"    add.s64 a{h}, {ba}, 64;",
            f"    add.s64 ba{h}, {ba}, 8;",
            f"    selp.b64 a{h}, ba{h}, a{h}, odd;",
            f"    selp.b64 d{h}1, d{h}1, x{h}, odd;",
            f"    @{p} red.relaxed.gpu.global.add.u64 [a{h}], d{h}1;"]
    return out


# Exact fp32 sums on a per-row grid (a timing prototype: docs/performance/backward.md#open-leads):
# values that are all multiples of 2^e add exactly, in any order, while every partial sum
# stays within 2^(e + 24); ``x + C - C`` with C = 1.5 * 2^(e + 24) rounds x (|x| <= 2^(e + 24))
# to a multiple of 2^e (2^(e + 1) for the small ones), two full-rate adds a value. A real
# design takes e from a bound on each row's sum of |terms|; the prototype's C is one constant.
GRID_C = 24.0


def _round_to_grid(dst: str, x: str, c: str) -> list:
    """``dst = x + c - c``: x rounded to the grid of the constant (or register) ``c``."""
    return [f"    add.rn.f32 {dst}, {x}, {c};", f"    sub.rn.f32 {dst}, {dst}, {c};"]


def _grid_reds(red: str, h: str, p: str, ba: str, w: list) -> list:
    """``red`` (the fp32 line's reduction) after rounding the four values to GRID_C's grid."""
    c = _f32_imm(GRID_C)
    out = []
    for x in w:
        out += _round_to_grid(x, x, c)
    return out + [f"    @{p} " + red.format(ba, ", ".join(w))]


# The deterministic mode's exact two-word sums (exact_sums): the flag of a row is its grid
# code (bit 16 set; the biased exponents of C_hi and C_lo in bits 8-15 and 0-7), and each
# value goes as hi = x + C_hi - C_hi to the row's first D columns and lo = (x - hi) + C_lo
# - C_lo to the D after them: EXACT_LO_BYTES on from the hi word (rows of 2 x 512 fp32).
EXACT_LO_BYTES = 512 * 4


def _exact_reds(red: str, h: str, p: str, ba: str, w: list) -> list:
    """``red`` of a row's four values split into the two words of its code's grids."""
    f = f"f{h}"  # (``_lines_half``'s flag register of the row: its code)
    out = [f"    shr.b32 ch{h}, {f}, 8;", f"    and.b32 ch{h}, ch{h}, 255;",
           f"    shl.b32 ch{h}, ch{h}, 23;", f"    or.b32 ch{h}, ch{h}, 4194304;",
           f"    and.b32 cl{h}, {f}, 255;", f"    shl.b32 cl{h}, cl{h}, 23;",
           f"    or.b32 cl{h}, cl{h}, 4194304;"]
    u = [f"u{h}{i}" for i in range(4)]
    for x, y in zip(w, u):  # hi to y, then the exact residual x - hi rounded to the lo grid
        out += (_round_to_grid(y, x, f"ch{h}") + [f"    sub.rn.f32 {x}, {x}, {y};"]
                + _round_to_grid(x, x, f"cl{h}"))
    return out + [f"    @{p} " + red.format(ba, ", ".join(u)),
                  f"    add.s64 bl{h}, {ba}, {EXACT_LO_BYTES};",
                  f"    @{p} " + red.format(f"bl{h}", ", ".join(w))]


def _lines_half(h: str, k: int, reds) -> str:
    """One half: lanes l and l ^ 4 swap the base and the values of the row the other one
    adds, so each 16-byte reduction of the warp covers whole 128-byte lines. ``reds(h,
    predicate, address, values)``: the statements that add a row's four values."""
    b0, b1, fl = 16 + k, 24 + k, 48 + k
    v = [32 + k, 33 + k, 36 + k, 37 + k]  # this lane's values of the first row
    w = [40 + k, 41 + k, 44 + k, 45 + k]  # and of the second
    lines = [f"    selp.b64 bs{h}, ${b0}, ${b1}, odd;",
             f"    mov.b64 {{lo{h}, hi{h}}}, bs{h};",
             f"    shfl.sync.bfly.b32 lo{h}, lo{h}, 4, 0x1f, 0xffffffff;",
             f"    shfl.sync.bfly.b32 hi{h}, hi{h}, 4, 0x1f, 0xffffffff;",
             f"    mov.b64 br{h}, {{lo{h}, hi{h}}};",
             f"    shfl.sync.bfly.b32 on{h}, ${fl}, 4, 0x1f, 0xffffffff;"]
    lines += [f"    selp.b32 v{h}{i}, ${v[i]}, ${w[i]}, odd;" for i in range(4)]
    lines += [f"    shfl.sync.bfly.b32 v{h}{i}, v{h}{i}, 4, 0x1f, 0xffffffff;" for i in range(4)]
    for first in (True, False):  # the first row's line, then the second's
        lines += [f"    selp.b64 ba{h}, br{h}, ${b0}, odd;" if first else
                  f"    selp.b64 ba{h}, ${b1}, br{h}, odd;",
                  f"    add.s64 ba{h}, ba{h}, o;",
                  f"    selp.b32 f{h}, on{h}, ${fl}, odd;" if first else
                  f"    selp.b32 f{h}, ${fl}, on{h}, odd;",
                  f"    setp.ne.b32 p{h}, f{h}, 0;"]
        lines += [f"    selp.b32 w{h}{i}, v{h}{i}, ${v[i]}, odd;" if first else
                  f"    selp.b32 w{h}{i}, ${w[i]}, v{h}{i}, odd;" for i in range(4)]
        lines += reds(h, f"p{h}", f"ba{h}", [f"w{h}{i}" for i in range(4)])
    return "\n".join(lines) + "\n"


def _lines_ptx(evict_last: bool = False, packed: bool = False, convert: bool = True,
               grid: bool = False, exact: bool = False) -> str:
    """``evict_last``: each reduction carries an L2 evict-last cache policy (``createpolicy``
    once, then ``red...add.L2::cache_hint``, PTX 7.4+ / sm_80+): the accumulator's lines are
    the last the L2 evicts, which matters once the fp32 [N, D] rows outgrow it (T = 32768:
    84 MB). ``packed``: two s32 words a ``red.add.u64`` instead (``_packed_reds``, with
    ``convert``). ``grid``: the fp32 lines with each value rounded to a grid first
    (``_grid_reds``). ``exact``: each value as two words on its row's grids, two lines a
    row (``_exact_reds``)."""
    if evict_last:
        policy = "    .reg .b64 pol;\n    createpolicy.fractional.L2::evict_last.b64 pol, 1.0;\n"
        red = "red.relaxed.gpu.global.add.L2::cache_hint.v4.f32 [{}], {{{}}}, pol;"
    else:
        policy, red = "", "red.relaxed.gpu.global.add.v4.f32 [{}], {{{}}};"
    if packed:
        reds = functools.partial(_packed_reds, convert=convert)
    elif grid:
        reds = functools.partial(_grid_reds, red)
    elif exact:
        reds = functools.partial(_exact_reds, red)
    else:
        def reds(h, p, ba, w):
            return [f"    @{p} " + red.format(ba, ", ".join(w))]
    return ("{\n" + policy + "    .reg .pred odd;\n    .reg .b32 l, t;\n    .reg .b64 o;\n"
            + _lines_half_decls("x", packed, exact) + _lines_half_decls("y", packed, exact)
            + "    mov.u32 l, %laneid;\n    and.b32 t, l, 4;\n    setp.ne.b32 odd, t, 0;\n"
            + "    and.b32 l, l, 3;\n    mul.wide.u32 o, l, 16;\n"
            + _lines_half("x", 0, reds) + _lines_half("y", 2, reds)
            + "".join(f"    mov.b32 ${4 * i}, 0; mov.b32 ${4 * i + 1}, 0; mov.b32 ${4 * i + 2}, 0; "
                      f"mov.b32 ${4 * i + 3}, 0;\n" for i in range(4))
            + "}")


_LINES_PTX_SRC = _lines_ptx()
_LINES_EVICT_LAST_PTX_SRC = _lines_ptx(evict_last=True)
_LINES_PACKED_PTX_SRC = _lines_ptx(packed=True)
_LINES_PACKED_RAW_PTX_SRC = _lines_ptx(packed=True, convert=False)
_LINES_GRID_PTX_SRC = _lines_ptx(grid=True)
_LINES_EXACT_PTX_SRC = _lines_ptx(exact=True)
_LINES_CONSTRAINTS_SRC = ("=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,"
                          "l,l,l,l,l,l,l,l,l,l,l,l,l,l,l,l,"
                          "r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,"
                          "r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r")


if gl is not None:
    # the same two numbers, for use inside the kernels
    PARTITION_WARPS = gl.constexpr(NUM_WARPS)
    PARTITION_REGS = gl.constexpr(CONSUMER_REGS)
    _FAKE_PTX = gl.constexpr(_FAKE_PTX_SRC)
    _ST_PTX = gl.constexpr(_ST_PTX_SRC)
    _ST_CS_PTX = gl.constexpr(_ST_CS_PTX_SRC)
    _ST16_PTX = gl.constexpr(_ST16_PTX_SRC)
    _ST16_BF16_PTX = gl.constexpr(_ST16_BF16_PTX_SRC)
    _FAKE_CONSTRAINTS = gl.constexpr(_FAKE_CONSTRAINTS_SRC)
    _LINES_PTX = gl.constexpr(_LINES_PTX_SRC)
    _LINES_PTX_EVICT_LAST = gl.constexpr(_LINES_EVICT_LAST_PTX_SRC)
    _LINES_PTX_PACKED = gl.constexpr(_LINES_PACKED_PTX_SRC)
    _LINES_PTX_PACKED_RAW = gl.constexpr(_LINES_PACKED_RAW_PTX_SRC)
    _LINES_PTX_GRID = gl.constexpr(_LINES_GRID_PTX_SRC)
    _LINES_PTX_EXACT = gl.constexpr(_LINES_EXACT_PTX_SRC)
    _LINES_CONSTRAINTS = gl.constexpr(_LINES_CONSTRAINTS_SRC)
    # cp.async gather into shared memory (3.8+: async_load)
    async_load = getattr(_cp, "async_load", None) or _cp.async_copy_global_to_shared
    # TMA tile load into shared memory (3.7+: async_load)
    tma_load = getattr(_tma, "async_load", None) or _tma.async_copy_global_to_shared
    # TMA tile store from shared memory, and the wait for its reads of shared memory
    tma_store = getattr(_tma, "async_store", None) or _tma.async_copy_shared_to_global
    tma_store_wait = _tma.store_wait
    # barrier of the threads of a partition (3.7+: gl.barrier)
    thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    # Triton 3.9's LLVM hoists every wgmma descriptor's arithmetic ahead of the chain of
    # wgmmas; with that many live, ptxas keeps them in vector registers and moves each into
    # a uniform one (R2UR) before its HGMMA. ``fresh`` at a call site keeps the index's
    # arithmetic there (docs/performance/backward.md#triton-39s-descriptors-kept-uniform-static).
    # Up to 3.8 the descriptors stay uniform without it, and the moves would cost
    # instructions (3.6: the forward's block loops 38-43 longer).
    FRESH_INDEX = gl.constexpr(TRITON_VERSION >= (3, 9))

    @gluon.jit
    def fresh(i):
        """``i`` (an int32 scalar) through a side-effecting move under Triton 3.9+, which no
        pass may hoist or merge with another call's: a buffer index formed where it is used."""
        if FRESH_INDEX:
            i = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [i], dtype=gl.int32, is_pure=False,
                                          pack=1)
        return i

    @gluon.jit
    def fresh_zero(z):
        """Under Triton 3.9+, ``fresh(z)`` of a zero the compiler cannot see (a buffer index's
        constant part is then added to it); else the constant 0, as if not there."""
        if FRESH_INDEX:
            return fresh(z)
        else:
            return 0

    @gluon.jit
    def finish_softmax(m, l_sum, sink2, HAS_SINK: gl.constexpr):
        """common.finish_softmax in Gluon: (w, lse) of a row, IEEE semantics for
        non-finite sinks and scores (docs/design.md#non-finite-values)."""
        if HAS_SINK:
            m_f = gl.maximum(m, sink2)
            m_s = gl.where(m_f == float("-inf"), 0.0, m_f)
            rescale = gl.exp2(m - m_s)
            l_f = l_sum * rescale + gl.exp2(sink2 - m_s)
        else:
            m_s = m
            rescale = 1.0
            l_f = l_sum
        empty = l_f == 0.0
        l_safe = gl.where(empty, 1.0, l_f)
        w = gl.where(empty, 0.0, rescale / l_safe)
        lse = gl.where(empty, float("-inf"), (m_s + gl.log2(l_safe)) * 0.6931471805599453)
        if HAS_SINK:
            w = gl.where(sink2 == float("inf"), 0.0, w)
            lse = gl.where(sink2 == float("inf"), float("inf"), lse)
        return w, lse

    @gluon.jit
    def tile_token(ORDER, pos, HAS_LEN: gl.constexpr):
        """The token (offset) of a persistent kernel's token position ``pos``: ``pos``, or
        with lengths in their balanced order (HAS_LEN 1) ``ORDER[pos]`` (``balanced_order``);
        with lengths in token order (HAS_LEN 2) ``pos``."""
        if HAS_LEN == 1:
            t = gl.load(ORDER + pos).to(gl.int64)
        else:
            t = pos.to(gl.int64)
        return t

    @gluon.jit
    def load_ids(idx_row, k0, K, offs):
        """Ids of slots k0 + offs (-1 past K), in the layout of ``offs``."""
        offs_k = k0 + offs
        return gl.load(idx_row + offs_k, mask=offs_k < K, other=-1)

    @gluon.jit
    def fake_group_base(row_ptr, offs_d):
        """[slot, column] -> the int64 address of the column's 16-column group in the slot's
        fp32 row (a thread holds 2 rows x 4 groups of a 64-column piece: 8 distinct values)."""
        return (row_ptr[:, None] + (offs_d[None, :] // 16) * 16).to(gl.int64)

    @gluon.jit
    def red_f32x4_fake(group_base, acc, on):
        """Add a [64, 64] fp32 piece in the wgmma accumulator layout to fp32 rows kept in
        *fake column order*: column 16g + 8h + 2l + b of a row is stored at 16g + 4l + 2h + b
        (``fake_col``), so the four values a thread holds of one row in a 16-column group are
        adjacent and one 16-byte reduction (``red.global.add.v4.f32``, sm_90) adds them: a
        quarter of the reductions of scalar adds, half of Triton's 8-byte ones. The
        conversion to kv's dtype undoes the order.

        ``pack=8`` hands one asm instance a thread's registers i..i+7, which the wgmma layout
        orders (r,c) (r,c+1) (r+8,c) (r+8,c+1) (r,c+8) (r,c+9) (r+8,c+8) (r+8,c+9), with
        c = 16g + 2l, l = lane % 4 (tests/test_sm90_compile.py checks the layout). $0-$7 are
        dummy outputs, $8-$15 the group bases, $16-$23 the values, $24-$31 ``on`` per element:
        a row whose ``on`` is 0 (a masked slot) is not added at all. (The predicate also keeps
        ptxas from serialising the wgmmas, which it did with unpredicated reductions.)
        """
        return gl.inline_asm_elementwise(_FAKE_PTX, _FAKE_CONSTRAINTS, [group_base, acc, on], dtype=gl.int32,
                                         is_pure=False, pack=8)

    @gluon.jit
    def st_f32x4_fake(group_base, acc, on, STREAM: gl.constexpr):
        """Store a [64, 64] fp32 piece to fp32 rows in fake column order, 16 bytes an
        instruction: ``red_f32x4_fake``'s addressing with ``st.global.v4.f32`` (``STREAM``:
        with the streaming hint ``.cs``) instead of the reduction; half the store
        instructions of the wgmma layout's natural pairs. Rows whose ``on`` is 0 are skipped."""
        if STREAM:
            return gl.inline_asm_elementwise(_ST_CS_PTX, _FAKE_CONSTRAINTS, [group_base, acc, on],
                                             dtype=gl.int32, is_pure=False, pack=8)
        return gl.inline_asm_elementwise(_ST_PTX, _FAKE_CONSTRAINTS, [group_base, acc, on], dtype=gl.int32,
                                         is_pure=False, pack=8)

    @gluon.jit
    def st_f16x4_fake(group_base, acc, on):
        """Store a [64, 64] (or [64, 32]) fp32 piece rounded to fp16 in rows of fp16, in fake
        column order (``red_f32x4_fake``'s order; ``group_base`` the byte address of a row's
        16-column group in the fp16 row), 8 bytes an instruction, streaming: the
        deterministic mode's 16-bit partial rows (the values already scaled:
        ``backward_gluon._store_16``). Rows whose ``on`` is 0 are skipped."""
        return gl.inline_asm_elementwise(_ST16_PTX, _FAKE_CONSTRAINTS, [group_base, acc, on],
                                         dtype=gl.int32, is_pure=False, pack=8)

    @gluon.jit
    def st_bf16x4_fake(group_base, acc, on):
        """``st_f16x4_fake`` with the values rounded to bf16 (``cvt.rn.bf16x2.f32``), unscaled:
        the deterministic mode's bf16 partial rows (a measurement option,
        ``backward.PARTIAL_16_BF16``)."""
        return gl.inline_asm_elementwise(_ST16_BF16_PTX, _FAKE_CONSTRAINTS, [group_base, acc, on],
                                         dtype=gl.int32, is_pure=False, pack=8)

    @gluon.jit
    def _lines_asm(group_base, acc, on, PTX: gl.constexpr):
        """One of the whole-line forms (``_lines_ptx``: the operands of ``red_f32x4_lines``)."""
        return gl.inline_asm_elementwise(PTX, _LINES_CONSTRAINTS, [group_base, acc, on], dtype=gl.int32,
                                         is_pure=False, pack=16)

    @gluon.jit
    def red_f32x4_lines(group_base, acc, on, EVICT_LAST: gl.constexpr = False):
        """``red_f32x4_fake`` with whole 128-byte lines: the same sums into the same
        fake-ordered rows, but each reduction instruction of a warp adds 4 rows x 128 bytes
        instead of 8 rows x 64 bytes (half the L2 requests for the same bytes).

        In the wgmma layout the 4 lanes of a quad hold one row (lanes 4q..4q+3: row q, and
        q + 8), so a row's 16-column group is 64 bytes per instruction. Here quads q and
        q ^ 1 (lanes L and L ^ 4) pair up over two adjacent groups g, g + 1 (``pack=16``:
        a thread's registers i..i+15 are groups g and g + 1 of its two rows): the even quad
        keeps group g of its rows and sends group g + 1 to the odd quad, which keeps g + 1
        and sends g; row bases and ``on`` flags cross with them (``shfl.sync.bfly`` by 4).
        Then instruction A adds row 2p (even quad: its own group g, odd quad: the received
        group g + 1) and instruction B row 2p + 1, each a contiguous 128-byte line; likewise
        for rows + 8. $0-$15 are dummy outputs, $16-$31 the group bases, $32-$47 the values,
        $48-$63 ``on``. ``EVICT_LAST``: the reductions carry an L2 evict-last policy (an A/B
        option for accumulators larger than L2; see ``_LINES_PTX_EVICT_LAST``).
        """
        if EVICT_LAST:
            return _lines_asm(group_base, acc, on, _LINES_PTX_EVICT_LAST)
        return _lines_asm(group_base, acc, on, _LINES_PTX)

    @gluon.jit
    def red_s32x2_lines(group_base, acc, on, CONVERT: gl.constexpr = True):
        """``red_f32x4_lines``' rows and lines with each value scaled by ``PACKED_SCALE``,
        rounded to s32, and two adjacent words added by one ``red.add.u64`` into an
        accumulator of s32 words (``_packed_reds``): a timing prototype of exact sums.
        ``CONVERT`` False: the fp32 bits as the words (the same reductions without the
        conversion's instructions, to tell their cost apart)."""
        if CONVERT:
            return _lines_asm(group_base, acc, on, _LINES_PTX_PACKED)
        return _lines_asm(group_base, acc, on, _LINES_PTX_PACKED_RAW)

    @gluon.jit
    def red_f32x4_lines_exact(group_base, acc, code):
        """``red_f32x4_lines`` of exact two-word sums (``exact_sums``): ``code`` the row's
        grid code (0: masked) instead of ``on``; each value's hi word to the row's first 512
        columns, its lo word to the 512 after them (``_exact_reds``)."""
        return _lines_asm(group_base, acc, code, _LINES_PTX_EXACT)

    @gluon.jit
    def red_f32x4_lines_grid(group_base, acc, on):
        """``red_f32x4_lines`` with each value rounded to GRID_C's grid first
        (``_grid_reds``): a timing prototype of exact fp32 sums on a per-row grid."""
        return _lines_asm(group_base, acc, on, _LINES_PTX_GRID)


def balanced_order(topk_length: torch.Tensor, chunk: int, programs: int, n_hb: int) -> torch.Tensor:
    """int32 [T]: for each chunk of ``chunk`` tokens (one kernel launch; the last chunk may be
    shorter), the order in which a persistent Gluon kernel's ``programs`` take its tokens
    (offsets within the chunk), so that tokens of different lengths spread evenly over the
    programs.

    A program takes every ``programs``-th tile, a tile being one of a token's ``n_hb`` head
    blocks, so each round of tiles covers ``programs // n_hb`` tokens. The tokens go longest
    first, in rounds alternately left to right and right to left ("snake" order: one
    program's longest tile in a round is its shortest in the next), the last round left to
    right (a short last round falls to the first programs, which the round before gave the
    shortest tokens). In token order, with lengths uniform in [128, K], the longest program
    of 132 took about 17% longer than the mean. All chunks are ordered at once (a few small
    launches per call, not per chunk), with no host sync.
    """
    T = topk_length.shape[0]
    per_round = max(1, programs // max(1, n_hb))
    if chunk <= per_round:  # at most one tile per program: nothing to balance, no sort
        return torch.arange(T, device=topk_length.device, dtype=torch.int32) % chunk
    n_full = T // chunk
    parts = []
    if n_full:
        rows = topk_length[:n_full * chunk].reshape(n_full, chunk)
        parts.append(_snake(torch.argsort(rows, dim=1, descending=True, stable=True), per_round))
    if T > n_full * chunk:
        rows = topk_length[n_full * chunk:].reshape(1, -1)
        parts.append(_snake(torch.argsort(rows, dim=1, descending=True, stable=True), per_round))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _snake(srt: torch.Tensor, per_round: int) -> torch.Tensor:
    """Rows of sorted offsets [m, n] -> their snake orders, flattened (see balanced_order)."""
    m, n = srt.shape
    rounds = -(-n // per_round)
    grid = torch.nn.functional.pad(srt.to(torch.int32), (0, rounds * per_round - n), value=-1)
    grid = grid.view(m, rounds, per_round)
    # every other round, counting back from the last (a slice: an index list would be copied
    # to the device from pageable memory, which waits for the stream, and breaks capture)
    back = slice(rounds % 2, rounds - 1, 2)
    grid[:, back] = grid[:, back].flip(-1)
    return grid.reshape(m, -1)[:, :n].reshape(-1)  # the padding ends the (forward) last round


def fake_col(c: torch.Tensor) -> torch.Tensor:
    """Where column c of a dKV row sits in the fake-ordered fp32 accumulator (see
    ``red_f32x4_fake``): c = 16g + 8h + 2l + b -> 16g + 4l + 2h + b."""
    return (c & ~15) | (((c & 7) >> 1) << 2) | (((c >> 3) & 1) << 1) | (c & 1)


def gluon_unavailable() -> str | None:
    """Why this Triton cannot build the Gluon kernels (None when it can)."""
    return _IMPORT_ERROR


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    p = cuda_properties(torch.device("cuda", index))
    return p.major, p.minor


def hopper_rejects(call, v32: bool = False) -> str | None:
    """What both Gluon kernels require (None: ``call`` meets it): a Triton with Gluon's
    Hopper API, an sm_90 GPU, bf16/fp16 and D = 512 (``v32``: or D = 576 with d_v = 512).
    Each kernel's ``rejects`` adds its own rules, if any."""
    if gluon_unavailable():
        return f"no Gluon in this Triton ({gluon_unavailable()})"
    reason = not_sm90(call.device)
    if reason:
        return reason
    if call.dtype not in KERNEL_DTYPES:
        return f"dtype {call.dtype} (takes bfloat16 and float16)"
    if v32 and (call.D, call.d_v) == (576, 512):
        return None
    if call.D != 512:
        return f"head dim D={call.D} (takes D = 512{' or 576 with d_v = 512' if v32 else ''})"
    if call.d_v:
        return f"d_v={call.d_v} < D={call.D} (values narrower than keys)"
    return None


def not_sm90(device: torch.device) -> str | None:
    """None on an sm_90 GPU (H100/H200), else why not. The Gluon kernels use wgmma,
    setmaxnreg and 16-byte vector reductions: Hopper only."""
    if device.type != "cuda":
        return f"{device.type} tensors (the Gluon kernels run on CUDA)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    cc = _capability(index)
    if cc != (9, 0):
        return f"compute capability {cc[0]}.{cc[1]} (the Gluon kernels need sm_90, H100/H200)"
    return None
