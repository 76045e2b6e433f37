"""The D=512 kernel configurations compile for sm_90 (H100/H200) without a GPU.

Fails if a configuration needs more shared memory than a Hopper block may have, if its
PTX lost the tensor-core wgmma path (fell back to mma.sync), if ptxas serialises the
wgmmas for lack of registers, or if the Gluon kernels' block loops reload spilled values.
Registers and spills come from the ptxas this Triton uses for sm_90; a check that cannot
measure fails (sm90_compile.MeasureError).
"""
import pytest

from dsv4_sparse_attn.kernels.hopper import TRITON_VERSION
from sm90_compile import (H200_SMEM_LIMIT, compile_backward, compile_backward_gluon, compile_forward,
                          compile_forward_gluon, register_a_wgmma, wgmma_register_bases)

HEADS = [128, 64, 16]  # V4-Pro, V4-Flash, V4-Pro over 8-way tensor parallelism


def _sass(lines):  # cuobjdump's layout: /*pc*/ instruction ;
    return "\n".join(f"        /*{0x100 + 16 * i:04x}*/                   {t} ;" for i, t in enumerate(lines))


def test_register_a_wgmma_finds_writes_before_the_wait():
    """The checker behind ``register_a_hazards`` (ptxas 12.9, Triton 3.8's for sm_90, could
    reuse a register-operand wgmma's input registers before its wait: triton-lang/triton#11781),
    on hand-written SASS: a write before the wait, on a branch's path, by a later wgmma's
    accumulator, or after a wait that leaves this wgmma's group in flight is found; a write
    after the wait that retires it is not."""
    rs = "HGMMA.64x64x16.F32.BF16 R152, R184, gdesc[UR36], R152"
    ss = "HGMMA.64x64x16.F32.BF16 R120, gdesc[UR8], R120, gsb0"
    wait0, wait1 = "WARPGROUP.DEPBAR.LE gsb0, 0x0", "WARPGROUP.DEPBAR.LE gsb0, 0x1"
    assert register_a_wgmma(_sass([rs + ", gsb0", "MOV R185, RZ", wait0])) == (1, [(0x100, 0x110)])
    assert register_a_wgmma(_sass([rs + ", gsb0", wait0, "MOV R185, RZ"])) == (1, [])
    branch = [rs + ", gsb0", "@P0 BRA 0x140", wait0, "EXIT", "LDS.128 R184, [R2]", "EXIT"]
    assert register_a_wgmma(_sass(branch)) == (1, [(0x100, 0x140)])
    assert register_a_wgmma(_sass([rs, ss, wait1, "MOV R186, RZ", wait0])) == (1, [(0x100, 0x130)])
    assert register_a_wgmma(_sass([rs + ", gsb0", ss, wait1, "MOV R186, RZ"])) == (1, [])
    assert register_a_wgmma(_sass([rs + ", gsb0", "HGMMA.64x64x16.F32.BF16 R160, gdesc[UR8], R160, gsb0"])) \
        == (1, [(0x100, 0x110)])
    assert register_a_wgmma(_sass([ss, "MOV R120, RZ", wait0])) == (0, [])


# What the topk_length and 576/512 variants of the Triton kernels may spill beyond the plain
# D = 512 kernel (bytes, ptxas of the installed Triton): these are the fallback kernels,
# whose spills under 3.9 are those of docs/performance/backward.md#triton-39.
SPILL_MARGIN = 64


@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("has_sink", [True, False])
def test_forward_d512_compiles_for_sm90(H, has_sink):
    r = compile_forward(512, H, has_sink=has_sink, run_ptxas=False)
    assert r["shared"] <= H200_SMEM_LIMIT, r
    if H >= 64:  # wgmma needs 64-row head blocks
        assert r["wgmma"] > 0 and r["mma_sync"] == 0, r
    else:
        assert r["wgmma"] + r["mma_sync"] > 0, r


@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("atomic", [False, True])
def test_backward_d512_compiles_for_sm90(H, atomic):
    r = compile_backward(512, H, atomic=atomic, run_ptxas=False)
    assert r["shared"] <= H200_SMEM_LIMIT, r
    if H >= 64:
        assert r["wgmma"] > 0 and r["mma_sync"] == 0, r
    else:
        assert r["wgmma"] + r["mma_sync"] > 0, r


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_triton_kernels_with_topk_length_compile_for_sm90_without_spills(direction):
    """The per-token length (a loop bound read from memory) keeps the tensor-core path and
    adds at most SPILL_MARGIN spill bytes at H=128 to what this Triton's ptxas spills
    without it (3.6: none, 3.9: 52 in the backward, which spills 272 bytes without it)."""
    compile_fn = compile_forward if direction == "forward" else compile_backward
    base = compile_fn(512, 128)
    r = compile_fn(512, 128, has_len=True)
    assert r["wgmma"] > 0 and r["mma_sync"] == 0 and r["shared"] <= H200_SMEM_LIMIT, r
    assert r["spill_bytes"] <= base["spill_bytes"] + SPILL_MARGIN, (base, r)
    # P (forward) and dS / P (backward) enter their wgmmas from registers: none of those
    # registers rewritten before the wgmma's wait (register_a_wgmma)
    for x in (base, r):
        assert x["register_a_wgmma"] > 0 and x["register_a_hazards"] == [], x


@pytest.mark.parametrize("H", [128, 16])
def test_triton_kernels_for_the_v32_layout_compile_for_sm90(H):
    """D = 576 with d_v = 512 (64 score-only columns): shared memory under the limit, the
    tensor-core path at 64-head blocks, a forward that spills at most SPILL_MARGIN bytes
    more than at D = 512 (3.6: none at either; 3.9: 132 against 80)."""
    f = compile_forward(512, H, rope=64)
    base = compile_forward(512, H)
    assert f["shared"] <= H200_SMEM_LIMIT, f
    assert f["spill_bytes"] <= base["spill_bytes"] + SPILL_MARGIN, (base, f)
    assert f["register_a_hazards"] == [] and base["register_a_hazards"] == [], (base, f)
    for atomic in (False, True):
        b = compile_backward(512, H, rope=64, atomic=atomic)
        assert b["shared"] <= H200_SMEM_LIMIT and b["register_a_hazards"] == [], b
    if H >= 64:
        assert f["wgmma"] > 0 and f["mma_sync"] == 0 and b["wgmma"] > 0 and b["mma_sync"] == 0, (f, b)


@pytest.mark.parametrize("D", [512, 576])
@pytest.mark.parametrize("tile", [(1, 8, 4), (1, 4, 4), (4, 4, 4)])
def test_deterministic_fold_compiles_for_sm90(tile, D):
    """The deterministic fold's tiles (``backward.fold_tile``: one kv row a program, or four
    side by side) at the width they run (``backward.fold_block_d``: whole rows with one row a
    program, 512 columns at D = 512 and 1024 at 576; in the four-row tile 512 at D = 512 and
    256 at 576): no shared memory, (almost) no spill (Triton 3.9's ptxas spilled 4 bytes in
    the one-row build at 256 columns), at most 128 registers where a thread holds 64 loaded
    values at once (120-124 in the four-row tile at 512 columns, 94 in the one-row tile at
    1024, Triton 3.6) and 96 where it holds 32 (56 and 80)."""
    from dsv4_sparse_attn.kernels import backward as B
    from sm90_compile import compile_sm90

    types = dict(PARTIAL="*fp32", ORDER="*i64", SEG="*i64", ACC="*fp32")
    rows, unroll, warps = tile
    bd = B.fold_block_d(D, rows)
    assert bd == {(512, 1): 512, (512, 4): 512, (576, 1): 1024, (576, 4): 256}[D, rows]
    r = compile_sm90(B._dkv_reduce_kernel, types,
                     dict(D=D, BLOCK_D=bd, N_HB=1, MASK_D=D % bd != 0, ROWS=rows, UNROLL=unroll,
                          REVERSED=B.FOLD_ROWS_REVERSED), warps, 1)
    in_flight = rows * unroll * bd // (32 * warps)
    assert r["shared"] == 0 and r["registers"] <= (128 if in_flight > 32 else 96) and r["spill_bytes"] <= 8, r


@pytest.mark.parametrize("D, has_sink, has_dq", [(512, True, True), (512, False, False), (576, True, False),
                                                 (576, False, False)])
def test_backward_epilogue_compiles_for_sm90(D, has_sink, has_dq):
    """The backward's last launch (``backward.epilogue``) as it is launched: no shared memory
    beyond its reductions', no spill, and with a sink the ticket taken by an
    acquire-release atomic at GPU scope (the parts' stores ordered before it by a barrier,
    so the last program reads them all); with the fast mode's dQ parts (D = 512) too."""
    from dsv4_sparse_attn.kernels import backward as B
    from sm90_compile import compile_sm90

    types = dict(ACC="*fp32", GRAD_KV="*bf16", SINK="*fp32", LSE="*fp32", DELTA="*fp32", PART="*fp32",
                 GRAD_SINK="*fp32", TICKET="*i32", DQF="*fp32", DQ="*bf16")
    block_c = 512 if D == 512 else 64
    r = compile_sm90(B._epilogue_kernel, types,
                     dict(D=D, BLOCK_N=4096 // block_c, BLOCK_C=block_c, FAKE_ORDER=D == 512,
                          HAS_SINK=has_sink, SEG_T=B.SINK_SEG_T, BLOCK_H=16, SUM_SEG=32, SUM_H=128,
                          HAS_DQ=has_dq, DQ_BH=64), 4, 3)
    assert r["shared"] <= 16384 and r["spill_bytes"] == 0, r
    assert r["acq_rel_atomics"] == int(has_sink), r


@pytest.mark.parametrize("D", [512, 576])
@pytest.mark.parametrize("unroll, warps, preload", [(4, 2, True), (8, 4, True), (4, 4, False)])
def test_deterministic_fold_by_entry_runs_compiles_for_sm90(unroll, warps, preload, D):
    """The fold cut by entries (``backward._dkv_fold_runs_kernel``, ``FOLD_RUNS_CONFIG``):
    no shared memory, no spill, registers for its UNROLL partial rows and accumulator rows
    in flight (at most 128 at D = 512: 110 in the default (4, 2) build, Triton 3.6; 192 at
    576, whose rows are 1024 columns with 448 masked)."""
    from dsv4_sparse_attn.kernels import backward as B
    from sm90_compile import compile_sm90

    types = dict(PARTIAL="*fp32", ORDER="*i64", KEYS="*i32", SEG="*i64", ACC="*fp32")
    r = compile_sm90(B._dkv_fold_runs_kernel, types, dict(D=D, BLOCK_D=1 << (D - 1).bit_length(), N_HB=1,
                                                          UNROLL=unroll, PRELOAD=preload), warps, 1)
    assert r["shared"] == 0 and r["spill_bytes"] == 0 and r["registers"] <= (128 if D == 512 else 192), r


@pytest.mark.parametrize("has_len, dead", [(False, False), (True, True), (False, True), (2, True)],
                         ids=["", "topk_length", "dead_odd_block", "in_order"])
@pytest.mark.parametrize("has_sink", [True, False])
def test_gluon_forward_d512_compiles_for_sm90(has_sink, has_len, dead):
    """The Gluon kernel (the default forward for D=512, H>16 on Hopper), with and without
    per-token lengths (2: in token order, ``forward_gluon.TRAILING_MASKED_SKIPPED``), and
    without lengths where K % 128 is in [1, 64] (``DEAD``: the last pair's odd block
    skipped)."""
    r = compile_forward_gluon(has_sink=has_sink, has_len=has_len, dead=dead)
    assert r["shared"] <= H200_SMEM_LIMIT, r
    assert r["wgmma"] > 0 and r["mma_sync"] == 0, r
    # No register spills: hoisted wgmma descriptors that spilled once cost this kernel 19%
    # (docs/performance/forward.md#warp-specialisation-and-persistence). Under Triton 3.9,
    # with its descriptors kept uniform (hopper.fresh), ptxas spills one value (8-12 bytes)
    # in all but the default build, reloaded at most once a block loop.
    spill, reloads = (16, 1) if TRITON_VERSION >= (3, 9) else (0, 0)
    assert r["spill_bytes"] <= spill, r
    assert len(r["mma_loops"]) == 2 and all(lp["LDL"] <= reloads for lp in r["mma_loops"]), r["mma_loops"]
    assert all(lp["R2UR"] <= _r2ur_allowance("forward") for lp in r["mma_loops"]), r["mma_loops"]


@pytest.mark.parametrize("has_len, dead", [(False, False), (True, True), (False, True), (2, True)],
                         ids=["", "topk_length", "dead_odd_block", "in_order"])
@pytest.mark.parametrize("has_sink", [True, False])
def test_gluon_forward_v32_compiles_for_sm90(has_sink, has_len, dead):
    """The Gluon forward at D = 576, d_v = 512 (ROPE = 64: kv's score-only columns in a ring
    of their own, q's in registers, the output converted through the P buffers; 230,736-
    230,768 bytes). Where the dispatcher gives it the 576/512 layout (Triton 3.6-3.8): no
    wgmma serialisation, no spill reload in the block loops, at most a few spilled bytes
    outside them (3.6: none; 3.7-3.8: 4 with lengths). Under 3.9 ptxas reloads a spilled
    value (the shared-memory base) in the block loops: at most one per loop."""
    r = compile_forward_gluon(has_sink=has_sink, has_len=has_len, rope=64, dead=dead)
    base = compile_forward_gluon(has_sink=has_sink, has_len=has_len, dead=dead)
    assert r["shared"] <= H200_SMEM_LIMIT, r
    assert r["wgmma"] > 0 and r["mma_sync"] == 0, r
    # one block loop per consumer, each with the score-only columns' 4 more wgmmas (K = 64)
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    assert [lp["HGMMA"] for lp in r["mma_loops"]] == [lp["HGMMA"] + 4 for lp in base["mma_loops"]], \
        (base["mma_loops"], r["mma_loops"])
    # q's score-only columns enter those 4 from registers (2 consumers, 2 builds of the tile
    # loop), and nothing overwrites them before the wgmmas' wait (register_a_wgmma)
    assert r["register_a_wgmma"] == 8 and r["register_a_hazards"] == [], r
    if TRITON_VERSION >= (3, 9):
        assert r["wgmma_serialized"] is False and all(lp["LDL"] <= 1 for lp in r["mma_loops"]), r
        return
    assert r["wgmma_serialized"] is False, r
    assert all(lp["LDL"] == 0 for lp in r["mma_loops"]), r["mma_loops"]
    assert r["spill_bytes"] <= 16, r


@pytest.mark.parametrize("has_len", [False, True, 2], ids=["", "topk_length", "in_order"])
@pytest.mark.parametrize("red", [False, True], ids=["deterministic", "fast"])
def test_gluon_backward_d512_compiles_for_sm90(red, has_len):
    """The Gluon main kernel of the backward (the default for D=512 on Hopper), both modes,
    with and without per-token lengths (2: lengths in token order, ``launch(in_order=True)``);
    the deterministic one as H = 128 builds it, with the head-block pairs' code
    (test_gluon_backward_deterministic_pairs_code_only_where_pairs_run)."""
    r = compile_backward_gluon(red=red, has_len=has_len, paired=not red)
    assert r["shared"] <= H200_SMEM_LIMIT, r
    assert r["wgmma"] > 0 and r["mma_sync"] == 0, r
    # Short of registers, ptxas serialises every wgmma (info C7512): a loop-invariant
    # tensor of store offsets once did that to this kernel, and so do unpredicated
    # 16-byte reductions (docs/performance/backward.md#wgmma-serialisation).
    assert r["wgmma_serialized"] is False, r
    # A few hundred spill bytes, outside the tensor-core chain, are expected...
    assert r["spill_bytes"] <= 1024, r
    # ...but none reloaded in the consumers' block loops: a reload queues behind the warp
    # group's dKV stores, so the next block waits for them to drain (-8% backward time
    # once the P/dS descriptors stopped spilling;
    # docs/performance/backward.md#spill-reloads-behind-the-dkv-stores).
    assert len(r["mma_loops"]) == 2, r["mma_loops"]  # one block loop per consumer
    assert all(lp["LDL"] == 0 for lp in r["mma_loops"]), r["mma_loops"]
    assert all(lp["R2UR"] <= _r2ur_allowance("backward") for lp in r["mma_loops"]), r["mma_loops"]
    # Each consumer's half of a block's dKV rows (64 slots x 256 columns, 128 threads) goes
    # out 16 bytes at a time, in fake column order: 32 reductions a thread in the fast mode;
    # in the deterministic one 32 stores (two code paths: plain and streaming) and, for a
    # head-block pair's follower, 32 reductions.
    assert all(lp["REDG4"] == 32 for lp in r["mma_loops"]), r["mma_loops"]
    if not red:
        assert all(lp["STG"] == 64 for lp in r["mma_loops"]), r["mma_loops"]


@pytest.mark.parametrize("ablate", [64, 64 | 128], ids=["converted", "unconverted"])
def test_gluon_backward_packed_word_prototype_compiles_for_sm90(ablate):
    """The timing prototype of exact sums (``launch(ablate=64)``: the fast mode's reductions
    as two s32 words a ``red.add.u64``, ``hopper.red_s32x2_lines``; 128: unconverted)
    assembles for sm_90 as the launcher builds it, without serialising its wgmmas or
    reloading in its block loops (Triton 3.6.0: 4525 / 3887 instructions a loop against
    2483), and sends 64-bit reductions, not the 16-byte fp32 ones, which the option replaces."""
    r = compile_backward_gluon(red=True, split=2, dq_tma=True, ablate=ablate)
    assert r["shared"] <= H200_SMEM_LIMIT and r["wgmma_serialized"] is False, r
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    assert all(lp["LDL"] == 0 and lp["REDG4"] == 0 for lp in r["mma_loops"]), r["mma_loops"]
    base = compile_backward_gluon(red=True, split=2, dq_tma=True)
    assert all(lp["REDG4"] > 0 for lp in base["mma_loops"]), base["mma_loops"]


def test_gluon_backward_grid_rounding_prototype_compiles_for_sm90():
    """The timing prototype of exact fp32 sums on a grid (``launch(ablate=256)``: the fast
    mode's reductions, each value rounded to a grid by two adds first,
    ``hopper.red_f32x4_lines_grid``) assembles like the fast mode: no serialisation, no
    reload, the same 16-byte reductions, two more instructions a reduced value."""
    r = compile_backward_gluon(red=True, split=2, dq_tma=True, ablate=256)
    base = compile_backward_gluon(red=True, split=2, dq_tma=True)
    assert r["shared"] <= H200_SMEM_LIMIT and r["wgmma_serialized"] is False, r
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    assert all(lp["LDL"] == 0 for lp in r["mma_loops"]), r["mma_loops"]
    assert [lp["REDG4"] for lp in r["mma_loops"]] == [lp["REDG4"] for lp in base["mma_loops"]]
    # 4 values a reduction, 2 adds a value (ptxas must not fold x + C - C)
    assert all(lp["FADD"] >= b["FADD"] + 8 * b["REDG4"]
               for lp, b in zip(r["mma_loops"], base["mma_loops"])), (r["mma_loops"], base["mma_loops"])


def test_gluon_backward_bf16_partial_rows_compile_for_sm90():
    """The bf16 partial rows (``backward.PARTIAL_16_BF16``, a measurement option: unscaled
    stores) as the launcher builds them at D = 512: the scaled fp16 build's stores and
    wgmmas in a shorter loop (no segment maxima, scales or multiplies), no serialisation,
    no reload (3.9: as the fp16 build), the same spill outside the loops at most; and the
    folds of bf16 rows (``P16`` 3) without shared memory or spill."""
    from dsv4_sparse_attn.kernels import backward as B
    from dsv4_sparse_attn.kernels import backward_gluon as G
    from sm90_compile import compile_sm90

    if not G.partial16_default(512, 512):
        pytest.skip(f"16-bit partial rows are not a default under Triton {G.TRITON_VERSION}")
    dq_tma = bool(G.DQ_TMA)
    f16 = compile_backward_gluon(red=False, split=0, p16=True, dq_tma=dq_tma)
    bf16 = compile_backward_gluon(red=False, split=0, p16="bf16", dq_tma=dq_tma)
    assert bf16["wgmma_serialized"] is False and len(bf16["mma_loops"]) == 2, bf16
    assert bf16["spill_bytes"] <= f16["spill_bytes"], (bf16, f16)
    for b, f in zip(bf16["mma_loops"], f16["mma_loops"]):
        assert b["LDL"] <= f["LDL"] and b["HGMMA"] == f["HGMMA"] and b["STG"] == f["STG"], (b, f)
        assert b["size"] < f["size"] - 200, (b, f)
    types = dict(PARTIAL="*bf16", ORDER="*i64", SEG="*i64", ACC="*fp32", EXP="*i64")
    r = compile_sm90(B._dkv_reduce_kernel, types, dict(D=512, BLOCK_D=512, N_HB=1, MASK_D=False, ROWS=1,
                                                       UNROLL=8, P16=3, REVERSED=True), 4, 1)
    assert r["shared"] == 0 and r["spill_bytes"] == 0, r


@pytest.mark.parametrize("fold, n_part, chained", [(None, 1, False), ((8, 2), 1, False), ((4, 2), 2, False),
                                                   (None, 1, True), ((8, 2), 1, True), ((4, 2), 2, True)],
                         ids=["sorted", "fold-e8s2", "fold-h128", "chained", "chained-fold-e8s2",
                              "chained-fold-h128"])
def test_gluon_backward_fold_in_main_compiles_for_sm90(fold, n_part, chained):
    """``backward.FOLD_IN_MAIN`` (off): the deterministic 16-bit build with its rows stored at
    their ranks (``launch(ranks=...)``), and with the previous chunk's fold in the producer
    (``launch(fold=...)``; entries a tile and tiles in the ring as the launcher passes them at
    one and two head blocks); ``chained``: the same builds of ``backward.FOLD_CHAIN``'s
    launches (``launch(chain=...)``: the counters int32, ``PDL`` 3). Within the shared memory,
    no serialised wgmma, the consumers' block loops (at ``FOLD_CONSUMER_REGS`` with the fold)
    as clean as the default build's, with its wgmmas and stores; but the chained fold build's
    loops reload 3-4 values a block under Triton 3.6 (the fold's start, at two places in the
    producer, moves ptxas's allocation at 224 registers; under 3.9 one, as the default)."""
    from dsv4_sparse_attn.kernels import backward_gluon as G

    if not G.partial16_default(512, 512):
        pytest.skip(f"16-bit partial rows are not a default under Triton {G.TRITON_VERSION}")
    dq_tma = bool(G.DQ_TMA)
    base = compile_backward_gluon(red=False, split=0, p16=True, dq_tma=dq_tma)
    r = compile_backward_gluon(red=False, split=0, p16=True, dq_tma=dq_tma, sorted_rows=True, fold=fold,
                               n_part=n_part, chained=chained)
    assert r["shared"] <= H200_SMEM_LIMIT and r["wgmma_serialized"] is False, r
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    reloads = 1 if G.TRITON_VERSION >= (3, 9) else 4 if chained and fold is not None else 0
    for lp, b in zip(r["mma_loops"], base["mma_loops"]):
        assert lp["LDL"] <= reloads and lp["HGMMA"] == b["HGMMA"] and lp["STG"] == b["STG"], (lp, b)
        assert lp["size"] <= b["size"] + 16, (lp, b)  # (the ranks' shared load and index)


def test_gluon_backward_16_bit_store_ablations_compile_for_sm90():
    """The timing ablations of the 16-bit partial rows' stores (``launch(ablate=...)``,
    benchmarks/experiments/det_store_ablation_bench.py) against the default build: 8 (stores
    predicated off) keeps every store and wgmma; 8 | 1024 (not scaled either) the same
    stores and wgmmas in a shorter loop (the segment maxima, scales and multiplies out);
    512 no store in its loops. None serialises its wgmmas or reloads in a loop."""
    from dsv4_sparse_attn.kernels import backward_gluon as G

    if not G.partial16_default(512, 512):
        pytest.skip(f"16-bit partial rows are not a default under Triton {G.TRITON_VERSION}")
    dq_tma = bool(G.DQ_TMA)
    base = compile_backward_gluon(red=False, split=0, p16=True, dq_tma=dq_tma)
    off, unscaled, gone = (compile_backward_gluon(red=False, split=0, p16=True, dq_tma=dq_tma, ablate=a)
                           for a in (8, 8 | 1024, 512))
    for r in (base, off, unscaled, gone):
        assert r["wgmma_serialized"] is False and len(r["mma_loops"]) == 2, r
        assert all(lp["LDL"] <= (1 if G.TRITON_VERSION >= (3, 9) else 0) for lp in r["mma_loops"]), r
    for lp, b, u in zip(off["mma_loops"], base["mma_loops"], unscaled["mma_loops"]):
        assert lp["STG"] == b["STG"] == u["STG"] > 0 and lp["HGMMA"] == b["HGMMA"] == u["HGMMA"], (lp, b, u)
        assert u["size"] < lp["size"], (u, lp)
    assert all(lp["STG"] == 0 for lp in gone["mma_loops"]), gone["mma_loops"]


@pytest.mark.parametrize("hp, trans", [(64, False), (16, True)], ids=["h64", "h16-transposed"])
def test_gluon_backward_exact_sums_option_compiles_for_sm90(hp, trans):
    """The deterministic mode's exact two-word sums (``launch(exact_codes=...)``, a
    measurement option: ``hopper.red_f32x4_lines_exact``) in the fast mode's build: no
    serialisation, no more reloads than it, twice its 16-byte reductions (hi and lo words)
    and five adds a reduced value (ptxas must not fold x + C - C)."""
    kw = dict(red=True, split=2, dq_tma=True, hp=hp, trans=trans)
    r = compile_backward_gluon(exact=True, **kw)
    base = compile_backward_gluon(**kw)
    assert r["shared"] <= H200_SMEM_LIMIT and r["wgmma_serialized"] is False, r
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    for lp, b in zip(r["mma_loops"], base["mma_loops"]):
        assert lp["LDL"] <= b["LDL"] and lp["REDG4"] == 2 * b["REDG4"], (lp, b)
        assert lp["FADD"] >= b["FADD"] + 5 * 4 * b["REDG4"], (lp, b)


def test_gluon_backward_evict_last_option_compiles_for_sm90():
    """The fast mode with the L2 evict-last policy on its reductions (an A/B option,
    ``launch(evict_last=True)``): the same budget as without it, and the policy in the PTX."""
    r = compile_backward_gluon(red=True, evict_last=True)
    assert r["shared"] <= H200_SMEM_LIMIT and r["wgmma_serialized"] is False, r
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    assert all(lp["LDL"] == 0 for lp in r["mma_loops"]), r["mma_loops"]
    assert all(lp["REDG4"] == 32 for lp in r["mma_loops"]), r["mma_loops"]
    assert r["evict_last_reductions"] > 0, r


@pytest.mark.parametrize("split", [1, 2], ids=["single", "double"])
@pytest.mark.parametrize("has_len", [False, True, 2], ids=["", "topk_length", "in_order"])
@pytest.mark.parametrize("red", [False, True], ids=["deterministic", "fast"])
def test_gluon_backward_split_roles_compiles_for_sm90(red, has_len, split):
    """Both modes with the blocks' roles split in time (``launch(split=True)``): no
    serialisation and no reload in the block loops up to Triton 3.8, and a block's owner
    sends all its dKV rows (64 slots x 512 columns: 64 16-byte reductions a thread in its
    loop; in the deterministic mode also 128 stores, plain and streaming), with P and dS
    single- or double-buffered (``split`` 1 or 2). Under 3.9 none either since
    ``hopper.fresh`` (fast 4-6 a loop and deterministic 3-4 before it; two buffers 17-20 /
    25-28 while their indices were computed at run time, before 2a5ccf7: ``_pds_slot``'s
    ``OWNER``). (Under 3.7 the fast mode with two
    buffers and no lengths reloaded 38 values in one consumer's loop when the split roles
    were measured, so 3.7 kept the unsplit schedule; none at 084f569.)"""
    r = compile_backward_gluon(red=red, has_len=has_len, split=split)
    assert r["shared"] <= H200_SMEM_LIMIT and r["wgmma_serialized"] is False, r
    assert r["spill_bytes"] <= 1024, r
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    assert all(lp["LDL"] == 0 for lp in r["mma_loops"]), r["mma_loops"]
    # (the deterministic mode's reductions: a head-block pair's follower's, whose code a
    # build for one head block leaves out under 3.9: backward_gluon._pairs_code)
    from dsv4_sparse_attn.kernels import backward_gluon
    want = 64 if red or backward_gluon._pairs_code(False, True) else 0
    assert all(lp["REDG4"] == want for lp in r["mma_loops"]), r["mma_loops"]
    if not red:
        assert all(lp["STG"] == 128 for lp in r["mma_loops"]), r["mma_loops"]


@pytest.mark.parametrize("hp, rope", [(64, 0), (16, 0), (64, 64), (16, 64)],
                         ids=["h64", "h16", "v32", "v32-h16"])
@pytest.mark.parametrize("has_len", [False, True, 2], ids=["", "topk_length", "in_order"])
def test_gluon_backward_16_bit_partial_rows_compile_for_sm90(has_len, hp, rope):
    """The deterministic build with 16-bit partial rows (``launch(partial_exp=...)``: fp16
    rows, the unsplit schedule, no head-block pairs) as the launcher builds it: no
    serialisation, no reload in the block loops (3.9: one, as timed), no reduction but the
    576/512 layout's four a block into its dQ scratch (``rope``; its build without the
    pairs' code, with dQ by TMA: ``_pairs_code``). Only where it is a default
    (``PARTIAL_16_LAYOUTS``; 3.6: 104-120 spill bytes outside the loops at D = 512, as the
    fp32 rows' build; 292 at 576)."""
    from dsv4_sparse_attn.kernels import backward_gluon as G

    if not G.partial16_default(512 + rope, 512):
        pytest.skip(f"16-bit partial rows are not a default at D = {512 + rope} "
                    f"under Triton {G.TRITON_VERSION}")
    if has_len == 2 and rope:
        pytest.skip("lengths in token order (backward.TRAILING_MASKED_SKIPPED) run at D = d_v only")
    dq_tma = bool(G.DQ_TMA_ROPE if rope else G.DQ_TMA)
    r = compile_backward_gluon(red=False, split=0, p16=True, has_len=has_len, hp=hp, dq_tma=dq_tma, rope=rope)
    assert r["shared"] <= H200_SMEM_LIMIT and r["wgmma_serialized"] is False, r
    assert r["spill_bytes"] <= 1024, r
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    reloads = 1 if G.TRITON_VERSION >= (3, 9) else 0  # (3.9's build at D = 512: one a loop, timed so)
    assert all(lp["LDL"] <= reloads and lp["REDG4"] == (4 if rope else 0)
               for lp in r["mma_loops"]), r["mma_loops"]


@pytest.mark.parametrize("has_len", [False, True], ids=["", "topk_length"])
def test_gluon_backward_deterministic_pairs_code_only_where_pairs_run(has_len):
    """The deterministic build of a launch with head-block pairs (H = 128) holds their code
    (a follower adds its rows to the leader's with 16-byte reductions: 32 a block loop);
    without pairs (one head block) Triton 3.9's build leaves it out (no reduction in its
    loops; ``backward_gluon._pairs_code``); no reload in either, and 3.6-3.8 build
    the same kernel for both (their measured builds: the same PTX)."""
    from dsv4_sparse_attn.kernels import backward_gluon

    split = backward_gluon._split(True, None, 2, 1024)  # (the schedule of a launch with pairs)
    paired = compile_backward_gluon(red=False, has_len=has_len, split=split, paired=True)
    single = compile_backward_gluon(red=False, has_len=has_len, split=split)
    for r in (paired, single):
        assert r["wgmma_serialized"] is False and len(r["mma_loops"]) == 2, r
    assert all(lp["REDG4"] > 0 for lp in paired["mma_loops"]), paired["mma_loops"]
    assert all(lp["LDL"] == 0 for lp in paired["mma_loops"]), paired["mma_loops"]
    if TRITON_VERSION < (3, 9):
        assert single["ptx_sha"] == paired["ptx_sha"]
        return
    assert all(lp["REDG4"] == 0 for lp in single["mma_loops"]), single["mma_loops"]
    assert all(lp["LDL"] == 0 for lp in single["mma_loops"]), single["mma_loops"]


@pytest.mark.parametrize("split", [0, 2], ids=["unsplit", "double"])
@pytest.mark.parametrize("red", [False, True], ids=["deterministic", "fast"])
def test_gluon_backward_qd_tma_compiles_for_sm90(red, split):
    """q and dO by TMA (``backward_gluon.QD_TMA``): eight TMA instructions in the producer (a
    [64, 128] tile is two 64-column boxes under the 128-byte swizzle, issued by two warps),
    the consumers' block loops as with cp.async (the same wgmmas, reductions and stores, and
    no more reloads in the schedules each Triton runs by default), the same shared memory."""
    base = compile_backward_gluon(red=red, split=split)
    r = compile_backward_gluon(red=red, split=split, qd_tma=True)
    assert base["tma_loads"] == 0 and r["tma_loads"] == 8, (base["tma_loads"], r["tma_loads"])
    assert r["shared"] == base["shared"] <= H200_SMEM_LIMIT and r["wgmma_serialized"] is False, r
    assert r["spill_bytes"] <= base["spill_bytes"], (r["spill_bytes"], base["spill_bytes"])
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    for lp, lb in zip(r["mma_loops"], base["mma_loops"]):
        assert (lp["HGMMA"], lp["REDG4"], lp["STG"]) == (lb["HGMMA"], lb["REDG4"], lb["STG"]), (lp, lb)
        assert lp["LDL"] <= lb["LDL"], (lp, lb)


@pytest.mark.parametrize("early", [2, 3])
@pytest.mark.parametrize("red", [False, True], ids=["deterministic", "fast"])
def test_gluon_backward_qd_early_release_compiles_for_sm90(red, early):
    """q and dO quarters released early (``backward_gluon.QD_EARLY``, split 2, TMA loads): one
    predicated mbarrier arrive a block, one more barrier (8 bytes of shared memory), and the
    block loops as with TMA alone (the same wgmmas, reductions and stores, no more reloads:
    one arrive a quarter had cost 23 a loop under Triton 3.6; under 3.9, whose schedule is
    the unsplit one, up to 2 more than TMA alone)."""
    base = compile_backward_gluon(red=red, split=2, qd_tma=True)
    r = compile_backward_gluon(red=red, split=2, qd_tma=True, qd_early=early)
    assert r["tma_loads"] == 8 and r["wgmma_serialized"] is False, r
    assert r["shared"] == base["shared"] + 8 <= H200_SMEM_LIMIT, (r["shared"], base["shared"])
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    for lp, lb in zip(r["mma_loops"], base["mma_loops"]):
        assert (lp["HGMMA"], lp["REDG4"], lp["STG"]) == (lb["HGMMA"], lb["REDG4"], lb["STG"]), (lp, lb)
        assert lp["LDL"] <= lb["LDL"] + (2 if TRITON_VERSION >= (3, 9) else 0), (lp, lb)


@pytest.mark.parametrize("red,split,has_len", [
    (False, 0, False), (False, 0, True), (True, 0, True), (True, 1, False), (True, 2, False),
    (True, 2, True)],
    ids=["deterministic", "deterministic-topk_length", "fast-unsplit-topk_length", "fast-single",
         "fast-double", "fast-double-topk_length"])
def test_gluon_backward_dq_tma_compiles_for_sm90(red, split, has_len):
    """dQ staged in the tile's q quarters and stored by TMA (``backward_gluon.DQ_TMA``): two
    TMA stores a consumer, no more shared memory, and the block loops as with the plain
    stores (the same wgmmas, reductions and stores, no more reloads). A first form in which
    only the consumer not owning the last block waited reloaded 51 values a loop in the fast
    split 2 schedule with lengths. (Under Triton 3.9, split 2 with lengths and dQ by TMA
    reloaded 25 a loop against 19 before 2a5ccf7; the same count since.)"""
    base = compile_backward_gluon(red=red, split=split, has_len=has_len)
    r = compile_backward_gluon(red=red, split=split, has_len=has_len, dq_tma=1)
    assert base["tma_stores"] == 0 and r["tma_stores"] == 4, (base["tma_stores"], r["tma_stores"])
    assert r["shared"] <= base["shared"] <= H200_SMEM_LIMIT, (r["shared"], base["shared"])
    assert r["wgmma_serialized"] is False, r
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    for lp, lb in zip(r["mma_loops"], base["mma_loops"]):
        assert (lp["HGMMA"], lp["REDG4"], lp["STG"]) == (lb["HGMMA"], lb["REDG4"], lb["STG"]), (lp, lb)
        assert lp["LDL"] <= lb["LDL"], (lp, lb)


@pytest.mark.parametrize("evict_last", [False, True], ids=["", "evict_last"])
@pytest.mark.parametrize("has_len", [False, True], ids=["", "topk_length"])
def test_gluon_backward_default_schedule_reloads_nothing(has_len, evict_last):
    """The fast mode's default schedule on this Triton (``backward_gluon.SPLIT_ROLES``: split
    roles where their loops are clean, Triton 3.6, 3.8 and 3.9) has no spill reload in its
    block loops; with the L2
    evict-last policy on its reductions too (the default at long contexts,
    ``backward_gluon.EVICT_LAST_MIN_L2``), with the policy in the PTX."""
    from dsv4_sparse_attn.kernels import backward_gluon

    r = compile_backward_gluon(red=True, has_len=has_len, split=backward_gluon._split(False, None),
                               dq_tma=backward_gluon.DQ_TMA, evict_last=evict_last)
    assert r["wgmma_serialized"] is False and len(r["mma_loops"]) == 2, r
    assert all(lp["LDL"] == 0 for lp in r["mma_loops"]), r["mma_loops"]
    assert all(lp["R2UR"] <= _r2ur_allowance("backward") for lp in r["mma_loops"]), r["mma_loops"]
    assert (r["evict_last_reductions"] > 0) == evict_last, r


@pytest.mark.parametrize("hp", [16, 32])
@pytest.mark.parametrize("red", [False, True], ids=["deterministic", "fast"])
def test_gluon_backward_small_head_tiles_compile_for_sm90(red, hp):
    """A tile of H <= 16 or 32 heads (``backward_gluon._head_pad``): its dKV products contract
    over ``hp`` heads in this Triton's default schedule of each mode, so a block loop holds
    fewer wgmma instructions than at 64 (K = 16: one k-step a product; 32: two, of four),
    with the same reductions and the same (no) reloads."""
    from dsv4_sparse_attn.kernels import backward_gluon

    split = backward_gluon._split(not red, None, 1, 1024)
    base = compile_backward_gluon(red=red, split=split)
    r = compile_backward_gluon(red=red, split=split, hp=hp)
    assert r["shared"] <= H200_SMEM_LIMIT and r["wgmma_serialized"] is False, r
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    assert all(lp["LDL"] == 0 for lp in r["mma_loops"]), r["mma_loops"]
    for lp, lb in zip(r["mma_loops"], base["mma_loops"]):
        assert lp["HGMMA"] < lb["HGMMA"] and lp["REDG4"] == lb["REDG4"], (lp, lb)


@pytest.mark.parametrize("dq_tma", [0, 1], ids=["dq_stores", "dq_tma"])
@pytest.mark.parametrize("hp", [16, 32])
def test_gluon_backward_transposed_small_head_tiles_compile_for_sm90(hp, dq_tma):
    """The fast mode's transposed small-head tiles (``_consume_tile_split_t``, split 2): no
    serialisation, the same 64 reductions a block loop as the untransposed tile, smaller
    shared buffers for P^T and dS^T, and at most one reload a loop (Triton 3.6-3.8: one in
    one consumer's loop at 16 heads with dQ by TMA, timed with it under 3.6; 3.9: none).
    Built in this Triton's split schedule, or split 2 where its default is the unsplit one
    (3.7, 3.9: ``launch(split=2, transposed=True)`` runs it there)."""
    from dsv4_sparse_attn.kernels import backward_gluon

    split = backward_gluon._split(False, None, 1, 1024) or 2
    r = compile_backward_gluon(red=True, split=split, hp=hp, trans=True, dq_tma=dq_tma)
    base = compile_backward_gluon(red=True, split=split, hp=hp, dq_tma=dq_tma)
    assert r["wgmma_serialized"] is False and r["shared"] < base["shared"], (r, base["shared"])
    assert len(r["mma_loops"]) == 2, r["mma_loops"]
    assert all(lp["LDL"] <= 1 for lp in r["mma_loops"]), r["mma_loops"]
    assert all(lp["REDG4"] == 64 for lp in r["mma_loops"]), r["mma_loops"]
    assert r["tma_stores"] == 4 * dq_tma, r["tma_stores"]


def _r2ur_allowance(kernel: str) -> int:
    """Moves into uniform registers (R2UR) allowed in a block loop of the Gluon ``kernel``:
    none. Up to Triton 3.8 ptxas forms the wgmma descriptors in the uniform datapath (64-bit
    uniform adds, no move). Triton 3.9's LLVM hoists every descriptor's arithmetic ahead of
    the chain of wgmmas, and with that many live ptxas computed them in vector registers and
    moved each into a uniform one before its wgmma (65 a forward loop, 154-224 a backward
    one); each call site's buffer index through ``hopper.fresh`` keeps them uniform
    (docs/performance/backward.md#triton-39s-descriptors-kept-uniform-static),
    but for one move left in a forward loop of some builds (no sink; lengths)."""
    return 1 if kernel == "forward" and TRITON_VERSION >= (3, 9) else 0


def test_wgmma_accumulator_layout_is_what_the_reductions_assume():
    """hopper.red_f32x4_fake packs a thread's registers 8 at a time as (r,c) (r,c+1) (r+8,c)
    (r+8,c+1) (r,c+8) ...: register bit 0 -> column + 1, bit 1 -> row + 8, bit 2 -> column + 8,
    then columns 16 and 32. A Triton that orders them otherwise must fail here, not give
    wrong gradients."""
    assert wgmma_register_bases() == [[0, 1], [8, 0], [0, 8], [0, 16], [0, 32]]
    # a [64, 32] one (the 576/512 layout's score-only halves): the same, without column 32
    assert wgmma_register_bases(n=32) == [[0, 1], [8, 0], [0, 8], [0, 16]]
    # its row slice: a thread's two rows r, r + 8, in that order (backward_gluon._row_pair)
    assert wgmma_register_bases(rows=True) == [[8]]


@pytest.mark.parametrize("dq_tma", [0, 1], ids=["dq_stores", "dq_tma"])
@pytest.mark.parametrize("red", [False, True], ids=["deterministic", "fast"])
def test_gluon_backward_v32_compiles_for_sm90(red, dq_tma):
    """The Gluon main kernel at D = 576, d_v = 512 (the 64 score-only columns in their own
    shared buffers, 229 KB in all), with dQ's value columns by 64 stores a thread or by TMA
    (``backward_gluon.DQ_TMA_ROPE``, the default under 3.6). Under Triton 3.6 and 3.7 no
    wgmma serialisation and no spill reload in the block loops; from 3.8 on ptxas
    serialises its wgmmas (3.8 every build but the deterministic one with dQ by TMA, 3.9
    the fast ones) and reloads up to 6 values a loop (3.8: 0-1; 3.9: 2-6, 11-19 before
    ``hopper.fresh``; bounded here: the dispatcher gives it the layout on every Triton)."""
    r = compile_backward_gluon(red=red, rope=64, dq_tma=dq_tma)
    assert r["shared"] <= H200_SMEM_LIMIT, r
    assert r["tma_stores"] == 4 * dq_tma, r["tma_stores"]
    assert r["wgmma"] > 0 and r["mma_sync"] == 0, r
    if TRITON_VERSION >= (3, 8):
        assert len(r["mma_loops"]) == 2 and all(lp["LDL"] <= 6 for lp in r["mma_loops"]), r["mma_loops"]
        return
    assert r["wgmma_serialized"] is False, r
    assert len(r["mma_loops"]) == 2 and all(lp["LDL"] == 0 for lp in r["mma_loops"]), r["mma_loops"]
    # four 64-column pieces and one of 32 rope columns per block and consumer, 16 bytes at a
    # time: 36 reductions a thread (deterministic: 36 stores on each of two paths, plain
    # and streaming, and the pair follower's 36 reductions), and 4 more for the block's dQ
    # rope product into the program's scratch rows
    assert all(lp["REDG4"] == 40 for lp in r["mma_loops"]), r["mma_loops"]
    if not red:
        assert all(lp["STG"] == 72 for lp in r["mma_loops"]), r["mma_loops"]


@pytest.mark.parametrize("split", [0, 2], ids=["unsplit", "double"])
def test_gluon_backward_remainder_launch_pdl_compile_for_sm90(split):
    """The two launches of lengths in token order (``launch(in_order=True)`` with
    ``REMAINDER_PDL``): the whole rounds' build (``HAS_LEN`` 2) signals its dependent launch
    once, the remainder's parts build waits for the launch before it once, and neither
    changes a block loop (the same instructions, no reload more) nor serialises a wgmma."""
    from dsv4_sparse_attn.kernels import backward_gluon

    if split and not backward_gluon._split(False, None, 1, 1024):
        pytest.skip("this Triton's fast mode runs the unsplit schedule")
    for opts, pdl, signals, waits in ((dict(has_len=2), 1, 1, 0), (dict(parts=True), 2, 0, 1)):
        base = compile_backward_gluon(red=True, split=split, dq_tma=True, **opts)
        r = compile_backward_gluon(red=True, split=split, dq_tma=True, pdl=pdl, **opts)
        assert (r["pdl_signals"], r["pdl_waits"]) == (signals, waits), (opts, r)
        assert (base["pdl_signals"], base["pdl_waits"]) == (0, 0), (opts, base)
        assert r["wgmma_serialized"] is False and r["shared"] == base["shared"], (opts, r, base)
        assert len(r["mma_loops"]) == len(base["mma_loops"]), (opts, r["mma_loops"])
        for lp, lb in zip(r["mma_loops"], base["mma_loops"]):
            assert (lp["HGMMA"], lp["REDG4"]) == (lb["HGMMA"], lb["REDG4"]), (opts, lp, lb)
            assert lp["LDL"] <= lb["LDL"], (opts, lp, lb)


@pytest.mark.parametrize("split", [0, 2], ids=["unsplit", "double"])
def test_gluon_backward_remainder_parts_compile_for_sm90(split):
    """The fast mode's build with the remainder's tiles in parts (``PARTS``: a part's dQ in
    fp32 through a run-time branch at the tile's end): the block loops as without (the same
    wgmmas and reductions, no more reloads), no serialised wgmma, the shared memory within
    a few bytes (16 more under 3.6); under 3.9, whose fast mode runs the unsplit schedule,
    one more reload in its loops (the split build, not run there, is not checked)."""
    from dsv4_sparse_attn.kernels import backward_gluon

    if split and not backward_gluon._split(False, None, 1, 1024):
        pytest.skip("this Triton's fast mode runs the unsplit schedule")
    base = compile_backward_gluon(red=True, split=split, dq_tma=True)
    r = compile_backward_gluon(red=True, split=split, dq_tma=True, parts=True)
    assert base["shared"] <= r["shared"] <= min(base["shared"] + 64, H200_SMEM_LIMIT), (r, base)
    assert r["wgmma_serialized"] is False, r
    assert len(r["mma_loops"]) == len(base["mma_loops"]), r["mma_loops"]
    for lp, lb in zip(r["mma_loops"], base["mma_loops"]):
        assert (lp["HGMMA"], lp["REDG4"]) == (lb["HGMMA"], lb["REDG4"]), (lp, lb)
        assert lp["LDL"] <= lb["LDL"] + (1 if TRITON_VERSION >= (3, 9) else 0), (lp, lb)
