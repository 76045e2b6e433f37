"""The deterministic mode with the previous chunk's fold inside the main kernel
(``backward.FOLD_IN_MAIN``, ``fold_gluon``) against the shipped fold beside it: the whole
deterministic call timed, every arm checked bitwise against the shipped call first.

    PYTHONPATH=src:tests:benchmarks:benchmarks/experiments [ARMS=a,b] [PASSES=2] \\
        [SHAPES="T,H,K;..."] python benchmarks/experiments/fold_in_main_bench.py > fold_in_main.jsonl

Arms: ``shipped``; ``half_budget`` (the shipped fold with the chunks the design takes: half
the partial-row budget, the cost of the smaller chunks alone); ``sorted_beside`` (the
design's sorted layout and chunks, each chunk folded right after its main kernel: the cost
of the layout, apart from the fold's place); ``no_fold`` (timing only: those launches
with no fold at all, the design's ceiling); ``in_main_chain`` / ``no_fold_chain`` (the
same with the chunks' launches chained, ``backward.FOLD_CHAIN``: three third-size buffers);
``in_main`` (the default
ring: ``backward_gluon.FOLD_TILE_ENTRIES`` entries a tile, ``FOLD_STAGES`` tiles,
``FOLD_TILES_A_BLOCK`` tiles after each slot block, ``FOLD_L2_AHEAD`` tiles prefetched into
the L2); ``in_main_a0`` / ``_a8`` (no prefetch, 8 tiles ahead); ``in_main_t4`` / ``_t16``
(4 or 16 tiles a block); ``in_main_e4s4`` (4 entries a tile, 4 tiles). One JSON line a shape: each
arm's ms (do_bench median, best of the passes), whether its bits are the shipped call's,
and its peak memory beyond the inputs; with GRAPH=1 also each arm replayed from a CUDA graph
(``_graph_ms``: the GPU's time without the host's, which the calls of many chunks can exceed).
"""
import json
import os

import torch
import triton.testing

from bench import backward_inputs, backward_mode
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon as G
from side_by_side import env_shapes, graphed, with_flags

GRAPH = os.environ.get("GRAPH", "0") == "1"
SHAPES = ((4096, 64, 640), (4096, 128, 1152), (4096, 16, 1152), (4096, 128, 512))


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=int(os.environ.get("REP", 200)))


def arms():
    """(name, backward-module flags, backward_gluon flags); ARMS (comma-separated) picks some."""
    half = kbwd.PARTIAL_BYTES // 2
    a = [
        ("shipped", {}, {}),
        ("half_budget", dict(PARTIAL_BYTES=half), {}),
        ("sorted_beside", dict(FOLD_IN_MAIN="beside"), {}),
        ("in_main", dict(FOLD_IN_MAIN=True), {}),
        ("no_fold", dict(FOLD_IN_MAIN="nofold"), {}),
        ("in_main_chain", dict(FOLD_IN_MAIN=True, FOLD_CHAIN=True), {}),
        ("no_fold_chain", dict(FOLD_IN_MAIN="nofold", FOLD_CHAIN=True), {}),
        ("in_main_a0", dict(FOLD_IN_MAIN=True), dict(FOLD_L2_AHEAD=0)),
        ("in_main_a8", dict(FOLD_IN_MAIN=True), dict(FOLD_L2_AHEAD=8)),
        ("in_main_t4", dict(FOLD_IN_MAIN=True), dict(FOLD_TILES_A_BLOCK=4)),
        ("in_main_t16", dict(FOLD_IN_MAIN=True), dict(FOLD_TILES_A_BLOCK=16)),
        ("in_main_e4s4", dict(FOLD_IN_MAIN=True), dict(FOLD_TILE_ENTRIES=4, FOLD_STAGES=4)),
    ]
    pick = [x for x in os.environ.get("ARMS", "").split(",") if x]
    return [x for x in a if not pick or x[0] in pick]


def main():
    passes = int(os.environ.get("PASSES", 2))  # odd passes run the arms in reverse order
    for T, H, K in env_shapes(SHAPES):
        q, kv, idx, sink, out, lse, do, dl = backward_inputs(T, H, K, 512)
        run = lambda: torch.ops.dsv4.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, 512 ** -0.5)  # noqa
        chosen = arms()
        row = dict(T=T, H=H, K=K)
        with backward_mode(True):
            ref = run()
            for i in range(passes):
                for name, flags, gflags in (chosen if i % 2 == 0 else chosen[::-1]):
                    f = with_flags(kbwd, with_flags(G, run, **gflags), **flags)
                    if i == 0:
                        try:
                            torch.cuda.synchronize()
                            base = torch.cuda.memory_allocated()
                            torch.cuda.reset_peak_memory_stats()
                            g = f()
                            torch.cuda.synchronize()
                        except Exception as e:  # (an arm that fails: reported, the others run)
                            row[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
                            continue
                        row[name + "_bitwise"] = all(torch.equal(a, b) for a, b in zip(ref, g))
                        if not row[name + "_bitwise"]:
                            row[name + "_max_diff"] = max((a.float() - b.float()).abs().max().item()
                                                          for a, b in zip(ref, g) if a.numel())
                        peak = torch.cuda.max_memory_allocated() - base
                        row[name + "_peak_extra_gib"] = round(peak / 2**30, 3)
                        del g
                    if name + "_error" in row:
                        continue
                    row[f"{name}_ms_{i}"] = round(bench(f), 4)
                    if GRAPH:  # the GPU's time alone: replayed from a CUDA graph (no host work)
                        try:
                            g, outs = graphed(f)
                            g.replay()
                            row[f"{name}_graph_bitwise"] = all(torch.equal(a, b) for a, b in zip(ref, outs))
                            row[f"{name}_graph_ms_{i}"] = round(bench(g.replay), 4)
                            del g, outs
                        except Exception as e:
                            row[name + "_graph_error"] = f"{type(e).__name__}: {e}"[:300]
        for name, _, _ in chosen:
            for kind in ("", "graph_"):
                got = [row[k] for k in row if k.startswith(f"{name}_{kind}ms_")]
                if got:
                    row[f"{name}_{kind}best"] = min(got)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
