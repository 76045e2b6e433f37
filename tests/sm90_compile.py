"""Compile a Triton kernel for sm_90 (H100/H200) on a machine without a GPU.

Mirrors what the JIT does at a real launch on Hopper: pointers are 16-byte aligned
and integer arguments that Triton specialises are divisible by 16 when ``div16``
says so. Returns the shared memory, the count of wgmma / mma.sync instructions
in the PTX, and from this Triton's own ptxas run (its sm_90 ptxas, with the flags it
passes: 3.9 uses a newer ptxas than 3.6-3.8, and 3.7 on add ``--regAllocOptLevel=2``,
which changes the spills) registers, spill bytes, whether the wgmmas are serialised and,
with Triton's cuobjdump, the SASS's innermost tensor-core loops (``mma_loops``) of the
cubin Triton built. A check that cannot measure fails (``MeasureError``): it never passes
on missing numbers.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


class MeasureError(RuntimeError):
    """The compile check could not measure what it asserts on (a tool or a number missing)."""


H200_SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
TARGET = GPUTarget("cuda", 90, 32)


def _nvidia_tool(name: str) -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise MeasureError(f"Triton {triton.__version__} ships no {name} at {path}")
    return path


def _compile_logged(src, options: dict):
    """``triton.compile`` for sm_90 and the log of the ptxas run Triton made for it.

    Registers, spills and serialisation are then those of the cubin that Triton builds and
    launches (and whose SASS ``mma_loops`` reads): its own ptxas with its own flags. (A
    second ptxas run with plain flags measured another build under 3.9, whose ptxas
    (CUDA 13.4) Triton runs with ``--regAllocOptLevel=2``: 380-440 spill bytes in the
    Gluon backward against the real build's 536-552; under 3.7 and 3.8 the same numbers.)
    The compile skips Triton's cache, whose hits run no ptxas; ``compile_sm90`` keeps its
    own results instead.
    """
    from triton import knobs

    buf = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(buf):
        knobs.nvidia.dump_ptxas_log = True  # Triton prints its ptxas -v log
        knobs.compilation.always_compile = True
        k = triton.compile(src, target=TARGET, options=options)
    return k, buf.getvalue()


def sass_of(cubin: bytes) -> str:
    """The cubin's SASS, by the cuobjdump this Triton ships."""
    tool = _nvidia_tool("cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout


def _instructions(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def mma_loops(sass: str) -> list[dict]:
    """The innermost loops of a kernel's SASS that hold wgmmas (HGMMA), with their counts of
    spill reloads (LDL), global stores (STG), HGMMA, 16-byte fp32 reductions (REDG4),
    FADD, instructions (size) and moves from a register to a uniform register (R2UR: a
    wgmma descriptor formed in the vector datapath, as under Triton 3.9, instead of the
    uniform one).

    A loop is a conditional backward branch and the code from its target to it (an
    mbarrier wait's out-of-line retry ends in an unconditional branch back: not a loop).
    """
    ins = _instructions(sass)
    loops = []
    for pc, text in ins:
        m = re.match(r"@!?U?P\w+\s+BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < pc:
            start = int(m.group(1), 16)
            body = [t for p, t in ins if start <= p <= pc]
            count = lambda op: sum(1 for t in body if re.match(op + r"\b", t))  # noqa: E731
            loops.append(dict(start=start, end=pc, LDL=count("LDL"), STG=count("STG"), HGMMA=count("HGMMA"),
                              R2UR=count("R2UR"), FADD=count("FADD"), size=len(body),
                              REDG4=sum(1 for t in body if re.match(r"REDG\S*F32x4", t))))
    mma = [lp for lp in loops if lp["HGMMA"]]
    return [lp for lp in mma
            if not any(o is not lp and lp["start"] <= o["start"] and o["end"] <= lp["end"] for o in mma)]


_UNWRITTEN = ("ST", "RED", "BRA", "BAR", "WARPGROUP", "SYNCS", "EXIT", "RET", "CALL", "MEMBAR", "FENCE",
              "ISETP", "FSETP", "DSETP", "PLOP3", "BSSY", "BSYNC", "NOP", "R2UR", "S2UR", "VOTEU", "CCTL",
              "ERRBAR", "CGAERRBAR", "DEPBAR", "WARPSYNC", "ELECT", "U")  # no vector register written


def _written(text: str) -> range | None:
    """The vector registers an instruction writes (its first operand), or None."""
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    op, _, rest = text.partition(" ")
    m = re.match(r"\s*R(\d+)\b", rest)
    if m is None or op.startswith(_UNWRITTEN):
        return None
    width = 1
    if op.startswith("HGMMA"):  # the accumulator: N / 2 fp32 registers of m64nNk16
        width = int(re.match(r"HGMMA\.64x(\d+)x", op).group(1)) // 2
    elif ".128" in op or re.match(r"LDSM\S*\.x4|LDSM\.16\.M\w+\.4", op):
        width = 4
    elif ".64" in op or op.startswith("IMAD.WIDE") or re.match(r"LDSM\S*\.x2|LDSM\.16\.M\w+\.2", op):
        width = 2
    return range(int(m.group(1)), int(m.group(1)) + width)


def register_a_wgmma(sass: str) -> tuple[int, list[tuple[int, int]]]:
    """The wgmmas whose A operand is in registers (``HGMMA ... R<acc>, R<a>, gdesc[...]``) and
    every write to those four registers that the SASS can reach before a wait retires the
    wgmma (``WARPGROUP.DEPBAR.LE gsb0, N`` with at least N groups committed after its own):
    ``(count, [(wgmma pc, writer pc), ...])``. PTX forbids such a write and ptxas 12.9 (Triton
    3.8's for sm_90) was found to emit one (fixed in CUDA 13.3, triton-lang/triton#11781):
    the wgmma would read the new value. Paths follow both sides of a conditional branch."""
    ins = _instructions(sass)
    at = {pc: i for i, (pc, _) in enumerate(ins)}
    n, hazards = 0, []
    for i, (pc, text) in enumerate(ins):
        m = re.match(r"HGMMA\S*\s+R\d+,\s+R(\d+),", text)
        if m is None:
            continue
        n += 1
        a = set(range(int(m.group(1)), int(m.group(1)) + 4))
        # state: (index, committed, groups committed after this wgmma's own)
        todo = [(i + 1, "gsb0" in text, 0)]
        seen = set()
        while todo:
            j, committed, after = todo.pop()
            if j >= len(ins) or (j, committed, after) in seen:
                continue
            seen.add((j, committed, after))
            pc2, t = ins[j]
            bare = re.sub(r"^@!?U?P\w+\s+", "", t)
            w = re.match(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", bare)
            if w and committed and after >= int(w.group(1), 16):
                continue  # retired on this path
            wr = _written(t)
            if wr is not None and a & set(wr):
                hazards.append((pc, pc2))
                continue
            if bare.startswith("HGMMA") and "gsb0" in bare:
                committed, after = True, min(after + (1 if committed else 0), 8)
            if bare.startswith("EXIT") and bare == t:
                continue
            b = re.match(r"BRA(?:\.\w+)*\s+0x([0-9a-f]+)", bare)
            if b is not None and int(b.group(1), 16) in at:
                todo.append((at[int(b.group(1), 16)], committed, after))
                if bare == t:  # unconditional: no fall-through
                    continue
            todo.append((j + 1, committed, after))
    return n, hazards


def ptx_fingerprint(ptx: str) -> str:
    """A fingerprint of the code, for refactors that must leave it unchanged: the PTX
    without its debug information (line info and the labels of debug scopes, which move
    with the source lines and the inlined functions)."""
    code = ptx.split(".section\t.debug", 1)[0]
    debug = re.compile(r"\s*(\.loc\b|\.file\b|\$L__tmp\d+:$)")
    code = "\n".join(ln for ln in code.splitlines() if not debug.match(ln))
    return hashlib.sha256(code.encode()).hexdigest()[:16]


_RESULTS: dict = {}  # compile_sm90's results in this process, by kernel, types, constants and options


def compile_sm90(jit_fn, types: dict, constexprs: dict, num_warps: int, num_stages: int,
                 div16=(), run_ptxas: bool = True, maxnreg: int | None = None) -> dict:
    """``types``: arg name -> Triton type ("*bf16", "i32", "fp32"); ints default to i32.
    Constexpr parameters left out of ``constexprs`` take their default, as at a launch."""
    if not run_ptxas:  # the front end alone (wgmma_register_bases needs it to run each time)
        return _compile_sm90(jit_fn, types, constexprs, num_warps, num_stages, div16, False, maxnreg)
    # (the JIT's cache key: the source and the globals it reads, which a test may patch)
    key = (jit_fn.cache_key, repr(sorted(types.items())), repr(sorted(constexprs.items())), num_warps,
           num_stages, tuple(div16), maxnreg)
    if key not in _RESULTS:
        _RESULTS[key] = _compile_sm90(jit_fn, types, constexprs, num_warps, num_stages, div16, True, maxnreg)
    return copy.deepcopy(_RESULTS[key])


def _compile_sm90(jit_fn, types, constexprs, num_warps, num_stages, div16, run_ptxas, maxnreg) -> dict:
    constexprs = {**{p.name: p.default for p in jit_fn.params if p.is_constexpr and p.has_default},
                  **constexprs}
    names = jit_fn.arg_names
    sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in names}
    attrs = {}
    for i, n in enumerate(names):
        if n in constexprs:
            continue
        if sig[n].startswith("*") or n in div16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src_cls = ASTSource
    if getattr(jit_fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as src_cls
    src = src_cls(jit_fn, sig, constexprs, attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    if run_ptxas:
        k, log = _compile_logged(src, options)
    else:
        k = triton.compile(src, target=TARGET, options=options)
    ptx = k.asm["ptx"]
    res = dict(
        shared=k.metadata.shared,
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
        registers=None,
        spill_bytes=None,
        wgmma_serialized=None,
        mma_loops=None,
        # reductions with an L2 cache policy operand (hopper.red_f32x4_lines(EVICT_LAST=True))
        evict_last_reductions=len(re.findall(r"red\.[\w.]*L2::cache_hint", ptx)),
        # TMA tile loads (cp.async.bulk.tensor, shared <- global) in the PTX: q and dO with
        # backward_gluon.QD_TMA; stores (global <- shared): dQ with backward_gluon.DQ_TMA
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared", ptx)),
        tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global", ptx)),
        # atomics with acquire-release semantics at GPU scope (the backward epilogue's ticket)
        acq_rel_atomics=len(re.findall(r"atom\.global\.gpu\.acq_rel\.", ptx)),
        # programmatic dependent launch: the signal to the next launch, the wait for the one before
        pdl_signals=len(re.findall(r"griddepcontrol\.launch_dependents", ptx)),
        pdl_waits=len(re.findall(r"griddepcontrol\.wait", ptx)),
        ptx_sha=ptx_fingerprint(ptx),
    )  # (left None only when run_ptxas is off)
    if run_ptxas:
        m = re.search(r"Used (\d+) registers", log)
        if m is None:
            raise MeasureError(f"no register count in Triton {triton.__version__}'s ptxas log:\n"
                               f"{log[-2000:]}")
        res["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes spill stores", log)
        if m is None:
            raise MeasureError(f"no spill count in Triton {triton.__version__}'s ptxas log:\n{log[-2000:]}")
        res["spill_bytes"] = int(m.group(1))
        # ptxas info C7512: too few registers, so every wgmma waits for the previous one
        res["wgmma_serialized"] = "wgmma.mma_async instructions are serialized" in log
        sass = sass_of(k.asm["cubin"])
        res["mma_loops"] = mma_loops(sass)
        res["register_a_wgmma"], res["register_a_hazards"] = register_a_wgmma(sass)
    return res


def wgmma_register_bases(rows: bool = False, n: int = 64) -> list:
    """The register bases ([row, col] per register bit) of a [64, ``n``] fp32 wgmma accumulator
    (n = 64 or 32) in this Gluon, as its linear layout states them (``hopper.red_f32x4_fake``
    relies on them);
    ``rows``: those of its row slice ([row] per bit; ``backward_gluon._row_pair`` relies on them)."""
    from wgmma_layout_probe import print_wgmma_layout, print_wgmma_layout_n32, print_wgmma_row_layout

    buf = io.StringIO()
    saved = os.environ.get("TRITON_ALWAYS_COMPILE")
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # the print runs only when the front end does
    try:
        with contextlib.redirect_stdout(buf):
            probe = (print_wgmma_row_layout if rows
                     else print_wgmma_layout if n == 64 else print_wgmma_layout_n32)
            compile_sm90(probe, {}, {}, 4, 1, run_ptxas=False)
    finally:
        if saved is None:
            del os.environ["TRITON_ALWAYS_COMPILE"]
        else:
            os.environ["TRITON_ALWAYS_COMPILE"] = saved
    m = re.search(r"reg_bases=(\[\[.*?\]\])", buf.getvalue())
    if m is None:
        raise MeasureError(f"no linear layout printed: {buf.getvalue()[:500]}")
    return eval(m.group(1))  # a list of [int, int] pairs


FWD_TYPES = dict(Q="*bf16", KV="*bf16", IDX="*i32", SINK="*fp32", OUT="*bf16", LSE="*fp32", LEN="*i32",
                 ORDER="*i32",
                 scale_log2="fp32")
FWD_DIV16 = ("stride_qt", "stride_qh", "stride_kvn", "stride_ot", "stride_oh")
BWD_TYPES = dict(Q="*bf16", KV="*bf16", IDX="*i32", DO="*bf16", LSE="*fp32", DELTA="*fp32",
                 DQ="*bf16", DKV="*fp32", ACC="*fp32", PARTIAL="*fp32", FLAGS="*i32", LEN="*i32", TOK="*i32",
                 ORDER="*i32", DQR="*fp32", TR="*i32", DQP="*bf16", DQF="*fp32", EXP="*i64",
                 RANK="*i32", FSID="*i16", FSEG="*i64", FP="*fp16", FE="*i64", SYNC="*fp32", scale="fp32",
                 scale_log2="fp32")
BWD_DIV16 = ("stride_qt", "stride_qh", "stride_kvn", "stride_dt", "stride_dh", "stride_gt", "stride_gh")


def compile_forward(D: int, H: int, cfg=None, has_sink=True, run_ptxas=True, has_len=False,
                    rope=0) -> dict:
    """``D``: the value columns; ``rope``: score-only columns after them (the V3.2 layout: 64)."""
    from dsv4_sparse_attn.kernels import forward_triton as F

    cfg = cfg or F.forward_config(D, H)
    consts = dict(D=D, ROPE=rope, BLOCK_H=cfg.BLOCK_H, BLOCK_K=cfg.BLOCK_K, HAS_SINK=has_sink,
                  HAS_LEN=has_len, DOT_FP32=False)
    return compile_sm90(F._sparse_mla_fwd_kernel, FWD_TYPES, consts, cfg.num_warps, cfg.num_stages,
                        FWD_DIV16, run_ptxas)


def compile_backward(D: int, H: int, cfg=None, atomic=False, run_ptxas=True, has_len=False,
                     rope=0) -> dict:
    from dsv4_sparse_attn.kernels import backward_triton as B

    cfg = cfg or B.backward_config(D, H)
    consts = dict(D=D, ROPE=rope, BLOCK_H=cfg.BLOCK_H, BLOCK_K=cfg.BLOCK_K, ATOMIC=atomic, HAS_LEN=has_len,
                  DOT_FP32=False)
    return compile_sm90(B._bwd_main_kernel, BWD_TYPES, consts, cfg.num_warps, cfg.num_stages,
                        BWD_DIV16, run_ptxas)


def compile_forward_gluon(has_sink=True, run_ptxas=True, has_len=False, rope=0, dead=False) -> dict:
    """``rope``: score-only columns after the 512 value columns (the 576/512 layout: 64);
    ``dead``: the build that skips a last odd block past the slots (as the launcher picks it:
    always with lengths, ``forward_gluon.dead_odd_block``)."""
    from dsv4_sparse_attn.kernels import forward_gluon as G
    from dsv4_sparse_attn.kernels import hopper

    consts = dict(D=512, HAS_SINK=has_sink, HAS_LEN=has_len, ROPE=rope, DEAD=bool(has_len or dead))
    return compile_sm90(G._sparse_mla_fwd_gluon_kernel, FWD_TYPES, consts, hopper.NUM_WARPS, 1,
                        FWD_DIV16, run_ptxas, maxnreg=hopper.MAXNREG)


def compile_backward_gluon(red=False, run_ptxas=True, has_len=False, lines=None, rope=0,
                           evict_last=False, split=0, qd_tma=False, qd_early=0, dq_tma=False, hp=64,
                           trans=False, parts=False, paired=False, ablate=0, exact=False, p16=False,
                           pdl=0, sorted_rows=False, fold=None, n_part=1, chained=False) -> dict:
    """``red``: the fast mode (16-byte reductions, in whole lines unless ``lines`` is False;
    default: as the launcher does); else the deterministic partial rows. ``paired``: the
    build of a launch with head-block pairs (deterministic, H = 128; else, as the launcher
    does for one head block, ``backward_gluon._pairs_code``). ``ablate``: the launcher's
    measurement-only option (``launch(ablate=...)``), with the reductions it selects.
    ``exact``: the deterministic mode's exact two-word sums (``launch(exact_codes=...)``:
    the reductions of the fast mode's build, PARTIAL the int32 codes). ``p16``: the
    deterministic mode's 16-bit partial rows (``launch(partial_exp=...)``: PARTIAL fp16, or
    bf16 with ``p16="bf16"``: ``backward.PARTIAL_16_BF16``).
    ``pdl``: the kernel's ``PDL`` (1: it signals its dependent launch at its start; 2: it
    waits for the launch before it at its end; ``launch(pdl=...)``).
    ``sorted_rows``: the 16-bit partial rows at their ranks (``launch(ranks=...)``), and with
    ``fold`` (entries a tile, tiles in the ring) the previous chunk's fold in the producer
    (``launch(fold=...)``), ``n_part`` head blocks a token; ``chained``: those launches chained
    (``launch(chain=...)``: SYNC int32, ``PDL`` 3)."""
    from dsv4_sparse_attn.kernels import backward_gluon as G
    from dsv4_sparse_attn.kernels import hopper

    consts = dict(D=512, RED=G._red(not red, lines, ablate, exact), ABL=ablate, HAS_LEN=has_len, ROPE=rope,
                  EVICT_LAST=evict_last, SPLIT=split, HP=hp, TRANS=trans, PARTS=parts,
                  PAIRS=G._pairs_code(paired, not red, rope, rows16=p16 and bool(dq_tma)), PDL=pdl)
    types = BWD_TYPES
    if exact or p16:
        types = dict(BWD_TYPES, PARTIAL="*i32" if exact else "*bf16" if p16 == "bf16" else "*fp16")
    if qd_tma:  # q and dO as [T * H, D] tensor descriptors of [64, 128] tiles (launch's _qd_descriptor)
        from triton.experimental.gluon import language as gl
        layout = gl.NVMMASharedLayout.get_default_for([1, G.BLOCK_H, 128], gl.bfloat16)
        desc = f"tensordesc<bf16[1, {G.BLOCK_H}, 128],{layout!r}>"
        types = {**BWD_TYPES, "Q": desc, "DO": desc}
        consts["QD_TMA"] = True
        consts["QD_EARLY"] = qd_early
    if dq_tma:  # dQ as the same kind of descriptor (launch: _qd_descriptor(grad_q))
        from triton.experimental.gluon import language as gl
        layout = gl.NVMMASharedLayout.get_default_for([1, G.BLOCK_H, 128], gl.bfloat16)
        types = {**types, "DQ": f"tensordesc<bf16[1, {G.BLOCK_H}, 128],{layout!r}>"}
        consts["DQ_TMA"] = int(dq_tma)  # staged in q's quarters
    if sorted_rows:
        consts["SORTED"] = 1
        if chained:
            consts["PDL"] = 3
            types = dict(types, SYNC="*i32")
        if fold:
            consts.update(FOLD_E=fold[0], FOLD_S=fold[1], FOLD_NP=n_part)
    return compile_sm90(G._bwd_main_gluon_kernel, types, consts, hopper.NUM_WARPS, 1, BWD_DIV16,
                        run_ptxas, maxnreg=hopper.MAXNREG)
