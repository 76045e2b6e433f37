"""The deterministic mode's fold and sort at T = 4096, where a chunk's pool rows hold most
of its entries: fold arms timed through the whole deterministic backward (bitwise against
the shipped fold: any arm must give the same bits), then the inversion of one group's sort
keys by other means than the shipped batched sort.

    PYTHONPATH=src:tests:benchmarks:benchmarks/experiments [ARMS=a,b] [PASSES=4] [SORT=1] [POOL=causal] \
        [SHAPES="T,H,K;..."] python benchmarks/experiments/det_fold_sort_bench.py > det_fold_sort.jsonl

Fold arms (``backward`` module options): the shipped fold by rows (one row a program,
rows in order); its programs in reverse row order (``FOLD_ROWS_REVERSED``: the pool rows,
the longest, first); the fold by entry runs (``FOLD_RUNS``, two configurations); other row
tiles (``fold_tile``). Sort arms, on the keys of the call's first group of chunks
(``_sort_keys_kernel``'s): the shipped ``torch.sort(dim=-1)`` of [g, n] int16 keys and
``searchsorted``; one 1-D sort a chunk; one 1-D sort of int32 keys (chunk * 2^16 + row);
segment bounds by ``bincount`` and ``cumsum`` instead of ``searchsorted``.
"""
import json
import os

import torch
import triton
import triton.testing

from bench import backward_inputs, backward_mode
from dsv4_sparse_attn.kernels import backward as kbwd
from side_by_side import env_shapes, with_flags

SHAPES = ((4096, 64, 640), (4096, 128, 1152), (4096, 16, 1152))  # (SHAPES in the environment: others)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=int(os.environ.get("REP", 200)))


def fold_arms():
    """(name, backward-module flags); ARMS (comma-separated names) picks some."""
    arms = [
        ("shipped", {}),  # (the default: since 19edd09, rows reversed and four entries a step at H = 128)
        ("at_19edd09", dict(FOLD_ROWS_REVERSED=False, fold_tile=lambda N, n, n_part=1: (1, 8, 4))),
        ("reversed", dict(FOLD_ROWS_REVERSED=True)),
        ("sort_inline", dict(SORT_BESIDE=False)),  # (the inversions on the caller's stream, as at 1a0c656)
        ("runs_4_2_16", dict(FOLD_RUNS=True, FOLD_RUNS_CONFIG=(4, 2, 16, True))),
        ("runs_8_4_8", dict(FOLD_RUNS=True, FOLD_RUNS_CONFIG=(8, 4, 8, True))),
        ("tile_1_8_8", dict(fold_tile=lambda N, n, n_part=1: (1, 8, 8))),
        ("tile_2_8_4_rev", dict(fold_tile=lambda N, n, n_part=1: (2, 8, 4), FOLD_ROWS_REVERSED=True)),
        ("tile_1_4_4_rev", dict(fold_tile=lambda N, n, n_part=1: (1, 4, 4), FOLD_ROWS_REVERSED=True)),
        ("tile_1_4_4", dict(fold_tile=lambda N, n, n_part=1: (1, 4, 4))),
    ]
    pick = [a for a in os.environ.get("ARMS", "").split(",") if a]
    return [a for a in arms if not pick or a[0] in pick]


def sort_arms(idx, T, K, N, chunk, g):
    dev = idx.device
    n = g * chunk * K
    keys = torch.empty((g, chunk * K), dtype=torch.int16, device=dev)
    kbwd._sort_keys_kernel[(triton.cdiv(n, 1024),)](
        idx, idx, idx, keys, 0, min(T, g * chunk), K, idx.stride(0), N, n,
        HAS_TOK=False, HAS_LEN=False, BLOCK=1024, num_warps=4)
    rows = torch.arange(N + 1, device=dev, dtype=torch.int16)

    def shipped():
        s, o = torch.sort(keys, dim=-1, stable=True)
        return s, o, torch.searchsorted(s, rows.expand(g, N + 1).contiguous())

    def per_chunk():
        out = []
        for c in range(g):
            s, o = torch.sort(keys[c], stable=True)
            out.append((s, o, torch.searchsorted(s, rows)))
        return out

    def composite():
        k32 = keys.to(torch.int32) + (torch.arange(g, device=dev, dtype=torch.int32) << 16)[:, None]
        s, o = torch.sort(k32.view(-1), stable=True)
        return s, o

    def bincount_seg():
        s, o = torch.sort(keys, dim=-1, stable=True)
        seg = torch.zeros((g, N + 1), dtype=torch.int64, device=dev)
        for c in range(g):
            seg[c, 1:] = torch.cumsum(torch.bincount(keys[c].to(torch.int32), minlength=N + 1)[:N], 0)
        return s, o, seg

    ref = shipped()
    chk = bincount_seg()
    same_seg = torch.equal(ref[2], chk[2])
    pc = per_chunk()
    same_pc = all(torch.equal(ref[1][c], pc[c][1]) for c in range(g))
    cs, co = composite()
    same_comp = torch.equal((co.view(g, -1) - torch.arange(g, device=dev)[:, None] * chunk * K), ref[1])
    return dict(n=n, g=g, shipped_ms=bench(shipped), per_chunk_ms=bench(per_chunk),
                composite_ms=bench(composite), bincount_seg_ms=bench(bincount_seg), same_seg=same_seg,
                same_per_chunk=same_pc, same_composite=same_comp)


def main():
    passes = int(os.environ.get("PASSES", 1))  # pass 2 runs the arms in reverse order
    for T, H, K in env_shapes(SHAPES):
        pool = os.environ.get("POOL", "random")  # ("causal": the sweep's long-context ids)
        n_pool = max(T // 4, K) if pool == "causal" else None
        q, kv, idx, sink, out, lse, do, dl = backward_inputs(T, H, K, 512, pool=pool, n_pool=n_pool)
        run = lambda: torch.ops.dsv4.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, 512 ** -0.5)  # noqa
        arms = fold_arms()
        row = dict(T=T, H=H, K=K, pool=pool)
        with backward_mode(True):
            ref = run()
            for i in range(passes):
                for name, flags in (arms if i % 2 == 0 else arms[::-1]):
                    f = with_flags(kbwd, run, **flags)
                    if i == 0:
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                        g = f()
                        torch.cuda.synchronize()
                        row[name + "_bitwise"] = all(torch.equal(a, b) for a, b in zip(ref, g))
                        peak = torch.cuda.max_memory_allocated() - base
                        row[name + "_peak_extra_gib"] = round(peak / 2**30, 3)
                        del g
                    row[f"{name}_ms_{i}"] = round(bench(f), 4)
        for name, _ in arms:
            row[name + "_best"] = min(row[f"{name}_ms_{i}"] for i in range(passes))
        print(json.dumps(row), flush=True)
        if not os.environ.get("SORT"):
            continue
        # the sort: the first group's keys (as the call makes them)
        N = kv.shape[0]
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count
        n_hb = triton.cdiv(H, 64)
        chunk = kbwd.chunk_tokens(T, n_hb, K, 512, kbwd.PARTIAL_BYTES * 256 // 129, n_sm)
        n_chunks = triton.cdiv(T, chunk)
        g = max(1, min(n_chunks, kbwd.SORT_ENTRIES // max(1, chunk * K)))
        s = sort_arms(idx, T, K, N, chunk, g)
        print(json.dumps(dict(T=T, H=H, K=K, chunk=chunk, n_chunks=n_chunks,
                              **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()})),
              flush=True)


if __name__ == "__main__":
    main()
