"""Whether the Gluon deterministic main kernel's producer can also fold (compile only, no GPU):
the default deterministic 16-bit build, rebuilt from backward_gluon.py's source with a fold
step after each slot block's gathers (two entries of the producer's current kv row by plain
loads, or the row's store and the next row's start: the state a fold inside the main kernel
carries through the producer's loops: the row, its entry bounds and four fp32 values a
thread), compiled for sm_90 at two register splits: the consumers at 232 (the producer 40,
as shipped) and at 224 (the producer 56). It reports each build's spill, whether the wgmmas
are serialised, the consumers' block loops (instructions, reloads) and the producer's
loops that issue gathers (instructions, cp.async copies, reloads).

    PYTHONPATH=src:tests python benchmarks/experiments/fold_in_producer_regs.py

The fold step is a register proxy, not the design's fold (which brings its rows by
asynchronous copies into shared memory): docs/performance/backward.md#open-leads, item 2.
"""
import importlib.util
import json
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))

_FOLD_STEP = '''@gluon.jit
def _fold_step(FP, FE, FO, FS, ACC, N, G, fi, fe, fend, facc, cols, sh, hi_sel):
    """(register probe) one fold step of the producer: two entries of the current row, or
    the row's store and the next row's start."""
    if fe < fend:
        for k in gl.static_range(2):
            e = fe + k
            ok = e < fend
            pos = gl.load(FO + e, mask=ok, other=0)
            x = gl.load(FP + pos * 512 + cols, mask=ok & (cols >= 0), other=0.0).to(gl.float32)
            w = gl.load(FE + pos, mask=ok, other=0)
            half = gl.where(hi_sel, (w >> 32).to(gl.int32), w.to(gl.int32))
            facc += x * (((half >> sh) & 0xFF) << 23).to(gl.float32, bitcast=True)
        fe = fe + 2
    else:
        if fi < N:
            gl.store(ACC + (N - 1 - fi).to(gl.int64) * 512 + cols, facc)
        fi = fi + G
        valid = fi < N
        r = gl.where(valid, N - 1 - fi, 0).to(gl.int64)
        fe = gl.load(FS + r)
        fend = gl.where(valid, gl.load(FS + r + 1), fe)
        facc = gl.load(ACC + r * 512 + cols, mask=valid & (cols >= 0), other=0.0)
    return fi, fe, fend, facc


'''

_PATCHES = [
    ("@gluon.jit\ndef _produce(", _FOLD_STEP + "@gluon.jit\ndef _produce("),
    ("    Q, DO, KV, IDX, LEN, ORDER, TR, UNITS, FOLDIO = io\n",
     "    Q, DO, KV, IDX, LEN, ORDER, TR, UNITS, FOLDIO, PFOLDIO = io\n"
     "    PFP, PFE, PFO, PFS, PFACC = PFOLDIO\n"
     "    acc_l: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])\n"
     "    fcols = gl.arange(0, 512, layout=acc_l)\n"
     "    fseg = fcols // 64\n"
     "    fsh = (fseg % 4) * 8\n"
     "    fhi = (fseg // 4) % 2 == 1\n"
     "    G = gl.num_programs(0)\n"
     "    fi = rank - G\n"
     "    fe = gl.load(PFS).to(gl.int64) * 0\n"
     "    fend = fe\n"
     "    facc = gl.zeros([512], gl.float32, acc_l)\n"),
    ("                cp.mbarrier_arrive(bars.index(_KV_READY + half), increment_count=False)\n",
     "                cp.mbarrier_arrive(bars.index(_KV_READY + half), increment_count=False)\n"
     "            fi, fe, fend, facc = _fold_step(PFP, PFE, PFO, PFS, PFACC, N, G, fi, fe, fend, facc,\n"
     "                                            fcols, fsh, fhi)\n"),
    ("        tcount += 1\n        bcount += nb_t\n    if FOLD:",
     "        tcount += 1\n        bcount += nb_t\n    if fi < N:\n"
     "        gl.store(PFACC + (N - 1 - fi).to(gl.int64) * 512 + fcols, facc)\n    if FOLD:"),
    ("DQP, DQF, EXP,\n    RANK,", "DQP, DQF, EXP, PFP, PFE, PFO, PFS,\n    RANK,"),
    ("fold_count, fold_ahead)), sizes,", "fold_count, fold_ahead), (PFP, PFE, PFO, PFS, ACC)), sizes,"),
]


def patched_module():
    """backward_gluon.py with the producer's fold step, loaded as a module of the package
    (its relative imports resolve) from a file (Gluon reads its functions' source)."""
    import dsv4_sparse_attn.kernels.backward_gluon as G
    src = open(G.__file__).read()
    for old, new in _PATCHES:
        if src.count(old) != 1:
            raise SystemExit(f"backward_gluon.py changed: the patch point {old[:60]!r} is not there once")
        src = src.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), "_fold_in_producer.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("dsv4_sparse_attn.kernels._fold_in_producer", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def build(G, consumer_regs, maxnreg):
    import sm90_compile as S
    from triton.experimental.gluon import language as gl

    from dsv4_sparse_attn.kernels import hopper
    G.PARTITION_REGS = gl.constexpr(consumer_regs)
    consts = dict(D=512, RED=G._red(True, None, 0, False), ABL=0, HAS_LEN=False, ROPE=0, EVICT_LAST=False,
                  SPLIT=0, HP=64, TRANS=False, PARTS=False,
                  PAIRS=G._pairs_code(False, True, 0, rows16=bool(G.DQ_TMA)), PDL=0)
    types = dict(S.BWD_TYPES, PARTIAL="*fp16", PFP="*fp16", PFE="*i64", PFO="*i64", PFS="*i64")
    if G.DQ_TMA:  # (as the launcher passes dQ by default)
        layout = gl.NVMMASharedLayout.get_default_for([1, G.BLOCK_H, 128], gl.bfloat16)
        types["DQ"] = f"tensordesc<bf16[1, {G.BLOCK_H}, 128],{layout!r}>"
        consts["DQ_TMA"] = int(G.DQ_TMA)
    sass = {}
    sass_of = S.sass_of
    S.sass_of = lambda cubin: sass.setdefault("text", sass_of(cubin))
    try:
        r = S._compile_sm90(G._bwd_main_gluon_kernel, types, consts, hopper.NUM_WARPS, 1, S.BWD_DIV16,
                            True, maxnreg)
    finally:
        S.sass_of = sass_of
    ops = []
    for line in sass["text"].splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops.append((int(m.group(1), 16), m.group(3), line))
    loops = set()
    for a, op, line in ops:
        t = re.search(r"0x([0-9a-f]+)", line) if op == "BRA" else None
        if t and int(t.group(1), 16) < a:
            body = [o for b, o, _ in ops if int(t.group(1), 16) <= b <= a]
            if "LDGSTS" in body:
                loops.add((len(body), body.count("LDGSTS"), body.count("LDL")))
    return dict(consumer_regs=consumer_regs, producer_regs=3 * maxnreg - 2 * consumer_regs,
                spill_bytes=r["spill_bytes"], wgmma_serialized=r["wgmma_serialized"],
                consumer_loops=[(x["size"], x["LDL"]) for x in r["mma_loops"]],
                producer_loops_size_copies_reloads=sorted(loops))


def main():
    G = patched_module()
    for consumer_regs in (232, 224):
        print(json.dumps(build(G, consumer_regs, 168)), flush=True)


if __name__ == "__main__":
    main()
