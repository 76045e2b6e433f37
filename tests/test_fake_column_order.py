"""The fast mode's dKV accumulator order, checked without a GPU.

The Gluon backward adds each [64 slots, 64 columns] piece of dKV with 16-byte reductions
(``hopper.red_f32x4_fake``) whose asm computes addresses from the lane id and the packed
registers. Here the asm's address arithmetic is replayed for every thread and register of
the wgmma accumulator layout (as this Triton states it) and must put every value at
``fake_col`` of its column, each 16-byte reduction on 16 contiguous, aligned bytes; the
conversion kernel must undo exactly that permutation (interpreter test).
"""
import pytest
import torch

from dsv4_sparse_attn.kernels.hopper import fake_col
from sm90_compile import wgmma_register_bases

LANE_BASES = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]  # wgmma m64nNk16, [row, col]
WARP_BASES = [[16, 0], [32, 0]]


def _coord(bases, bits):
    r = c = 0
    for i, (br, bc) in enumerate(bases):
        if bits >> i & 1:
            r ^= br
            c ^= bc
    return r, c


def test_reductions_put_every_value_at_its_fake_column():
    reg_bases = wgmma_register_bases()
    seen = {}
    for warp in range(4):
        for lane in range(32):
            wr, wc = _coord(WARP_BASES, warp)
            lr, lc = _coord(LANE_BASES, lane)
            regs = [(wr ^ lr ^ rr, wc ^ lc ^ rc) for rr, rc in (_coord(reg_bases, i) for i in range(32))]
            for p0 in range(0, 32, 8):  # one asm instance: registers p0..p0+7
                e = regs[p0:p0 + 8]
                # the asm: group base of elements 0 (row r) and 2 (row r+8), plus 16 bytes x (lane % 4)
                for base_elem, vals in ((0, (0, 1, 4, 5)), (2, (2, 3, 6, 7))):
                    row, col = e[base_elem]
                    addr = (col // 16) * 16 + 4 * (lane % 4)  # in fp32 words within the row
                    assert addr % 4 == 0  # 16-byte aligned
                    for k, v in enumerate(vals):
                        vr, vc = e[v]
                        assert vr == row, (warp, lane, p0, e)
                        seen[(vr, vc)] = addr + k
    assert len(seen) == 64 * 64  # every value of the piece, once
    want = fake_col(torch.arange(64)).tolist()
    assert all(seen[(r, c)] == want[c] for (r, c) in seen)


def test_fake_col_is_a_permutation_within_16_column_groups():
    c = torch.arange(512)
    f = fake_col(c)
    assert torch.equal(torch.sort(f).values, c)
    assert torch.equal(f // 16, c // 16)


def _lines_asm(src: str | None = None) -> list[str]:
    """The PTX statements of ``hopper.red_f32x4_lines`` (``hopper._LINES_PTX_SRC``, or ``src``)."""
    import re

    from dsv4_sparse_attn.kernels import hopper

    asm = (src or hopper._LINES_PTX_SRC).strip()[1:-1]  # (the braces of the asm block)
    stmts = [s.strip() for line in asm.splitlines() for s in line.split(";")]
    return [s for s in stmts if s and not s.startswith(".reg") and not re.match(r"mov\.b32 \$\d+, 0", s)]


def _f32(v):
    """A register as an f32 value: a Python float as is, an int (a 32-bit word) by its bits."""
    import struct

    return struct.unpack("<f", struct.pack("<I", v))[0] if isinstance(v, int) else v


def _s32(v):
    """A 32-bit word (held as 0 .. 2^32 - 1) as a signed integer."""
    return v - (1 << 32) if v >= 1 << 31 else v


def _lines_instances(row_stride, masked, value, pack=16, group_bytes=64, n=64):
    """The operands of every instance of a lines asm (``red_f32x4_lines``' layout, ``pack``
    = 16 registers of a thread; 8: the fake-order asm of ``st_f16x4_fake``) over the warps
    of a [64, ``n``] wgmma accumulator (n = 64 or 32): for each, one dict per lane with
    %laneid, the group bases of slot rows ``row_stride`` bytes apart (a 16-column group
    ``group_bytes``: 64 in fp32 rows, 32 in fp16 ones) at $pack.., the values
    ``value(row, col)`` at $2pack.. and the ``on`` flags (0 for the rows in ``masked``) at
    $3pack..."""
    reg_bases = wgmma_register_bases(n=n)
    n_regs = 2 ** len(reg_bases)
    for warp in range(4):
        wr, wc = _coord(WARP_BASES, warp)
        coords = []
        for lane in range(32):
            lr, lc = _coord(LANE_BASES, lane)
            coords.append([(wr ^ lr ^ rr, wc ^ lc ^ rc)
                           for rr, rc in (_coord(reg_bases, i) for i in range(n_regs))])
        for p0 in range(0, n_regs, pack):  # one asm instance: registers p0..p0+pack-1
            regs = []
            for lane in range(32):
                r = {"%laneid": lane}
                for i, (row, col) in enumerate(coords[lane][p0:p0 + pack]):
                    # group base (fake_group_base)
                    r[f"${pack + i}"] = row * row_stride + (col // 16) * group_bytes
                    r[f"${2 * pack + i}"] = value(row, col)
                    r[f"${3 * pack + i}"] = int(row not in masked)
                regs.append(r)
            yield regs


def _run_ptx(stmts, regs):
    """Replay the asm for the 32 lanes of a warp (``regs``: one dict per lane, operands and
    %laneid filled in). Returns the reductions and stores: [(lane, byte address, values)] per
    instruction."""
    import re

    import struct

    reds = []

    def val(lane, x):
        x = x.strip()
        if x in regs[lane]:
            return regs[lane][x]
        if x.startswith("0f"):  # an f32 immediate
            return struct.unpack(">f", bytes.fromhex(x[2:]))[0]
        return int(x, 0)

    for st in stmts:
        pred, op, args = re.match(r"(@!?\w+\s+)?([\w.]+)\s+(.*)", st).groups()
        if op.startswith("shfl.sync.bfly"):
            d, a, mask = [x.strip() for x in args.split(",")][:3]
            sent = [val(lane, a) for lane in range(32)]
            for lane in range(32):
                regs[lane][d] = sent[lane ^ int(mask, 0)]
            continue
        if op.startswith("red.") or op.startswith("st."):
            addr = re.search(r"\[(\w+)\]", args).group(1)
            vec = re.search(r"\{(.*)\}", args)
            names = vec.group(1).split(",") if vec else [args.split(",")[1]]
            p = pred.strip()[1:]
            reds.append([(lane, regs[lane][addr], [regs[lane][n.strip()] for n in names])
                         for lane in range(32) if regs[lane][p]])
            continue
        for lane in range(32):
            if pred:
                neg = pred.strip().startswith("@!")
                if bool(regs[lane][pred.strip().lstrip("@!")]) == neg:
                    continue
            r = regs[lane]
            if op == "mov.b64" and args.startswith("{"):  # split
                lo, hi = re.search(r"\{(.*)\}", args).group(1).split(",")
                v = val(lane, args.split("}")[1].strip(", "))
                r[lo.strip()], r[hi.strip()] = v & 0xFFFFFFFF, v >> 32
                continue
            if op == "mov.b64":  # join
                d, rest = args.split(",", 1)
                lo, hi = re.search(r"\{(.*)\}", rest).group(1).split(",")
                r[d.strip()] = r[lo.strip()] | r[hi.strip()] << 32
                continue
            a = [x.strip() for x in args.split(",")]
            if op == "mov.u32":
                r[a[0]] = val(lane, a[1])
            elif op == "and.b32":
                r[a[0]] = val(lane, a[1]) & val(lane, a[2])
            elif op == "setp.ne.b32":
                r[a[0]] = val(lane, a[1]) != val(lane, a[2])
            elif op == "mul.wide.u32":
                r[a[0]] = val(lane, a[1]) * val(lane, a[2])
            elif op in ("selp.b32", "selp.b64"):
                r[a[0]] = val(lane, a[1]) if r[a[3]] else val(lane, a[2])
            elif op == "add.s64":
                r[a[0]] = val(lane, a[1]) + val(lane, a[2])
            elif op == "mul.rn.f32":  # (the values are Python floats here: exact in the test)
                r[a[0]] = val(lane, a[1]) * val(lane, a[2])
            elif op in ("add.rn.f32", "sub.rn.f32"):  # (Python floats: the sum of two f32 is exact,
                b = _f32(val(lane, a[2])) * (1 if op == "add.rn.f32" else -1)  # then rounded to f32)
                r[a[0]] = struct.unpack("f", struct.pack("f", _f32(val(lane, a[1])) + b))[0]
            elif op == "shr.b32":
                r[a[0]] = val(lane, a[1]) >> val(lane, a[2])
            elif op == "shl.b32":
                r[a[0]] = (val(lane, a[1]) << val(lane, a[2])) & 0xFFFFFFFF
            elif op == "or.b32":
                r[a[0]] = val(lane, a[1]) | val(lane, a[2])
            elif op == "cvt.rni.s32.f32":
                r[a[0]] = round(val(lane, a[1])) & 0xFFFFFFFF
            elif op == "shr.s32":
                r[a[0]] = (_s32(val(lane, a[1])) >> val(lane, a[2])) & 0xFFFFFFFF
            elif op == "add.s32":
                r[a[0]] = (val(lane, a[1]) + val(lane, a[2])) & 0xFFFFFFFF
            elif op == "cvt.rn.f16x2.f32":  # the first source to the upper half
                hi, lo = (struct.unpack("<H", struct.pack("<e", _f32(val(lane, x))))[0] for x in a[1:3])
                r[a[0]] = hi << 16 | lo
            elif op == "cvt.rn.bf16x2.f32":  # (rounded to nearest even by torch)
                hi, lo = (torch.tensor(_f32(val(lane, x))).bfloat16().view(torch.int16).item() & 0xFFFF
                          for x in a[1:3])
                r[a[0]] = hi << 16 | lo
            else:
                raise AssertionError(f"the replay does not know {op!r}: extend it with the asm")
    return reds


def test_whole_line_reductions_put_every_value_at_its_fake_column():
    """``hopper.red_f32x4_lines``, replayed from its PTX for every warp, lane and register:
    every value of a piece lands once at fake_col of its column in its own row, masked rows
    (``on`` = 0) get nothing, and every reduction instruction of a warp covers whole
    128-byte lines (4 rows, 8 lanes each)."""
    from dsv4_sparse_attn.kernels import hopper

    if hopper.gluon_unavailable():
        pytest.skip(f"no Gluon in this Triton: {hopper.gluon_unavailable()}")
    stmts = _lines_asm()
    row_stride = 1 << 12  # bytes between two slot rows' accumulator rows (any multiple of 128)
    masked = {5, 17, 40}  # slot rows whose reductions are predicated off
    got = {}
    # (the value: which element it is)
    for regs in _lines_instances(row_stride, masked, lambda row, col: (row, col)):
        for instr in _run_ptx(stmts, regs):
            lines = set()
            for lane, addr, values in instr:
                assert addr % 16 == 0, (lane, addr)
                for k, (row, col) in enumerate(values):
                    word = addr // 4 + k
                    assert word // (row_stride // 4) == row, (lane, row, col)  # its own row
                    assert (row, col) not in got, (row, col)
                    got[(row, col)] = word % (row_stride // 4)
                lines.add(addr // 128)
            if len(instr) == 32:  # no masked row in this instruction
                assert len(lines) == 4, lines
    want = fake_col(torch.arange(64)).tolist()
    assert len(got) == 64 * (64 - len(masked))
    assert all(got[(r, c)] == want[c] and r not in masked for (r, c) in got)


def _check_words(got, row_stride, masked, check):
    """``got`` (4-byte word index -> value) holds one word for each unmasked row's 64 values,
    at fake_col of its column, and none for a masked row; ``check(row, col, value)``."""
    want = fake_col(torch.arange(64)).tolist()
    assert len(got) == 64 * (64 - len(masked))
    for row in range(64):
        for col in range(64):
            word = row * row_stride // 4 + want[col]
            if row in masked:
                assert word not in got
            else:
                check(row, col, got[word])


def test_grid_rounded_reductions_put_every_value_at_its_fake_column():
    """``hopper.red_f32x4_lines_grid`` (a timing prototype: the fp32 lines with each value
    rounded to a grid by ``x + C - C``), replayed from its PTX: every value lands once at
    fake_col of its column in its own row, as a multiple of the grid 2^e (C = 1.5 * 2^(e + 24))
    within one grid step of itself (two above 2^(e + 23)), negative and large values
    included; masked rows get nothing."""
    import math

    from dsv4_sparse_attn.kernels import hopper

    if hopper.gluon_unavailable():
        pytest.skip(f"no Gluon in this Triton: {hopper.gluon_unavailable()}")
    stmts = _lines_asm(hopper._LINES_GRID_PTX_SRC)
    row_stride = 1 << 12
    masked = {5, 17, 40}
    step = 2.0 ** (math.log2(hopper.GRID_C / 1.5) - 24)
    gen = torch.Generator().manual_seed(0)
    # magnitudes from 2^-30 to 2^24 grid steps (up to the range a row's bound allows)
    mags = torch.exp2(torch.empty(64, 64).uniform_(-30, 24, generator=gen)) * step
    signs = torch.where(torch.rand(64, 64, generator=gen) < 0.5, -1.0, 1.0)
    x = (mags * signs).float()
    got = {}
    for regs in _lines_instances(row_stride, masked, lambda row, col: float(x[row, col])):
        for instr in _run_ptx(stmts, regs):
            for lane, addr, values in instr:
                for k, v in enumerate(values):
                    assert addr // 4 + k not in got, (lane, addr)
                    got[addr // 4 + k] = v

    def check(row, col, v):
        xv = float(x[row, col])
        near = 2 * step if abs(xv) >= 2 ** 23 * step else step  # (x + C past 2^(e + 25): coarser)
        assert v / step == int(v / step) and abs(v - xv) <= near, (row, col, v, xv)

    _check_words(got, row_stride, masked, check)


def test_exact_two_word_reductions_put_both_words_at_their_fake_columns():
    """``hopper.red_f32x4_lines_exact`` (the deterministic mode's exact sums), replayed from
    its PTX: each value's hi word lands once at fake_col of its column in its own row and its
    lo word 512 columns on, both the words of ``exact_sums.split_words`` on the grids of the
    row's code (rows with different codes, values from far below the lo grid to the bound
    of the hi one, negative ones); rows whose code is 0 get nothing."""
    from dsv4_sparse_attn.kernels import exact_sums, hopper

    if hopper.gluon_unavailable():
        pytest.skip(f"no Gluon in this Triton: {hopper.gluon_unavailable()}")
    stmts = _lines_asm(hopper._LINES_EXACT_PTX_SRC)
    row_stride = 1 << 13  # bytes: rows of 2 x 512 fp32 (hi words, then lo words)
    masked = {5, 17, 40}
    gen = torch.Generator().manual_seed(0)
    e_hi = torch.randint(-20, 20, (64,), generator=gen)
    e_lo = e_hi - 24 + torch.randint(1, 12, (64,), generator=gen)
    codes = exact_sums.CODE_VALID | ((e_hi + 127) << 8) | (e_lo + 127)
    codes[list(masked)] = 0
    c_hi, c_lo = exact_sums.grids(codes)
    mags = torch.exp2(e_hi[:, None] - 1 - torch.empty(64, 64).uniform_(0, 60, generator=gen))
    signs = torch.where(torch.rand(64, 64, generator=gen) < 0.5, -1.0, 1.0)
    x = (mags * signs).float()
    want_hi, want_lo = exact_sums.split_words(x, c_hi[:, None], c_lo[:, None])
    got = {}
    for regs in _lines_instances(row_stride, set(), lambda row, col: float(x[row, col])):
        for r in regs:  # the flags: each row's code
            for i in range(16):
                r[f"${48 + i}"] = int(codes[(r[f"${16 + i}"]) // row_stride])
        for instr in _run_ptx(stmts, regs):
            for lane, addr, values in instr:
                for k, v in enumerate(values):
                    assert addr // 4 + k not in got, (lane, addr)
                    got[addr // 4 + k] = v
    want = fake_col(torch.arange(64)).tolist()
    assert len(got) == 2 * 64 * (64 - len(masked))
    for row in range(64):
        for col in range(64):
            word = row * row_stride // 4 + want[col]
            if row in masked:
                assert word not in got and word + 512 not in got
                continue
            assert got[word] == float(want_hi[row, col]), (row, col)
            assert got[word + 512] == float(want_lo[row, col]), (row, col)


@pytest.mark.parametrize("convert", [True, False])
def test_packed_word_reductions_put_every_value_at_its_fake_column(convert):
    """``hopper.red_s32x2_lines`` (two s32 words a ``red.add.u64``), replayed from its PTX
    for every warp, lane and register: each value, scaled and rounded, lands once at
    fake_col of its column in its own row as the s32 word that the 64-bit sums give back
    (the low word sign-extended, the high one after it), negative values included; masked
    rows get nothing, and every reduction instruction of a warp covers whole 64-byte halves
    of 4 rows' lines (8 lanes, 8 contiguous bytes each). Unconverted (``CONVERT=False``, a
    timing arm): the registers' bits land at the same words."""
    from dsv4_sparse_attn.kernels import hopper

    if hopper.gluon_unavailable():
        pytest.skip(f"no Gluon in this Triton: {hopper.gluon_unavailable()}")
    stmts = _lines_asm(hopper._LINES_PACKED_PTX_SRC if convert else hopper._LINES_PACKED_RAW_PTX_SRC)
    row_stride = 1 << 12
    masked = {5, 17, 40}

    def value(row, col):  # the integer the rounding must give, negative for a third
        return (row * 64 + col + 1) * (-1 if (row + col) % 3 == 0 else 1)

    def register(row, col):  # (unconverted: the register's bits are the word, here the s32 of v)
        v = value(row, col)
        return v / hopper.PACKED_SCALE if convert else v & 0xFFFFFFFF

    words = {}  # byte address -> 64-bit sum
    for regs in _lines_instances(row_stride, masked, register):
        for instr in _run_ptx(stmts, regs):
            halves = {}
            for lane, addr, (w,) in instr:
                assert addr % 8 == 0 and addr not in words, (lane, addr)
                words[addr] = w
                halves.setdefault(addr // 64, set()).add(addr % 64)
            if len(instr) == 32:  # no masked row in this instruction
                whole = all(h == set(range(0, 64, 8)) for h in halves.values())
                assert len(halves) == 4 and whole, halves
    got = {}
    for addr, w in words.items():
        lo = _s32(w & 0xFFFFFFFF)
        hi = (w - lo) >> 32 if convert else w >> 32  # (unconverted: no sign fix-up to undo)
        got[addr // 4], got[addr // 4 + 1] = lo, _s32(hi & 0xFFFFFFFF)

    def check(row, col, v):
        assert v == value(row, col), (row, col, v, value(row, col))

    _check_words(got, row_stride, masked, check)


def _statements(ptx: str) -> list[str]:
    return [s.strip() for line in ptx.strip()[1:-1].splitlines() for s in line.split(";") if s.strip()]


def test_partial_row_stores_use_the_reductions_addresses():
    """``st_f32x4_fake`` (the deterministic mode's 16-byte partial-row stores, plain and
    streaming) is ``red_f32x4_fake`` with each reduction replaced by a store of the same
    registers at the same address: the rows land in the fake column order the fold and
    the conversion expect (test above)."""
    from dsv4_sparse_attn.kernels import hopper

    red = _statements(hopper._FAKE_PTX_SRC)
    assert sum("red.relaxed.gpu.global.add.v4.f32 [" in s for s in red) == 2
    for op, ptx in (("st.global.v4.f32", hopper._ST_PTX_SRC), ("st.global.cs.v4.f32", hopper._ST_CS_PTX_SRC)):
        stores = _statements(ptx)
        assert sum(op + " [" in s for s in stores) == 2 and not any("red." in s for s in stores)
        assert stores == [s.replace("red.relaxed.gpu.global.add.v4.f32", op) for s in red]


def test_evict_last_variant_differs_only_in_the_cache_policy():
    """``red_f32x4_lines(..., EVICT_LAST=True)``: the same statements, the four reductions
    with an L2 evict-last policy operand, and the policy made once at the top."""
    from dsv4_sparse_attn.kernels import hopper

    base = hopper._LINES_PTX_SRC
    hinted = hopper._LINES_EVICT_LAST_PTX_SRC
    assert hinted.count("createpolicy.fractional.L2::evict_last.b64 pol, 1.0;") == 1
    assert hinted.count(".L2::cache_hint.v4.f32") == 4 == base.count("red.relaxed.gpu.global.add.v4.f32")
    policy = "    .reg .b64 pol;\n    createpolicy.fractional.L2::evict_last.b64 pol, 1.0;\n"
    undo = hinted.replace(policy, "").replace(".L2::cache_hint", "").replace(", pol;", ";")
    assert undo == base


def _half(bits: int, fmt: str) -> float:
    """A 16-bit word as the float it holds: fp16 or bf16."""
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(
        torch.float16 if fmt == "fp16" else torch.bfloat16).float().item()


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@pytest.mark.parametrize("n", [64, 32])
def test_16_bit_partial_row_stores_put_every_value_at_its_fake_column(n, fmt):
    """``hopper.st_f16x4_fake`` (the deterministic mode's 16-bit partial rows) and
    ``hopper.st_bf16x4_fake`` (bf16 rows, a measurement option: the same asm with the bf16
    conversion): replayed for every lane of the wgmma accumulator layout, each puts each
    value, rounded to its format, at ``fake_col`` of its column in its slot's 16-bit row, 8
    aligned bytes a store, and stores nothing for a row whose ``on`` is 0. ``n`` = 32: a
    [64, 32] piece (the 576/512 layout's score-only half of a Gluon consumer)."""
    from dsv4_sparse_attn.kernels import hopper

    stmts = _lines_asm(hopper._ST16_PTX_SRC)
    if fmt == "bf16":
        bf16 = _lines_asm(hopper._ST16_BF16_PTX_SRC)
        assert bf16 == [st.replace("cvt.rn.f16x2.f32", "cvt.rn.bf16x2.f32") for st in stmts]
        stmts = bf16
    row_bytes, masked = 1024 + 64, {5, 40}  # (a row stride past the row: no overlap)

    def value(row, col):
        return (row * 64 + col) / 7.0 - 300.0

    rows = {}
    for regs in _lines_instances(row_bytes, masked, value, pack=8, group_bytes=32, n=n):
        for store in _run_ptx(stmts, regs):
            for _, addr, words in store:
                assert addr % 8 == 0 and len(words) == 2
                row, off = divmod(addr, row_bytes)
                for k, w in enumerate(words):
                    for h in range(2):
                        rows[(row, off // 2 + 2 * k + h)] = _half(w >> (16 * h) & 0xFFFF, fmt)
    assert not any(r in masked for r, _ in rows)
    want = fake_col(torch.arange(n)).tolist()
    assert len(rows) == (64 - len(masked)) * n
    dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
    for row in range(64):
        if row in masked:
            continue
        for col in range(n):
            expect = torch.tensor(value(row, col)).to(dtype).float().item()
            assert rows[(row, want[col])] == expect, (row, col)
