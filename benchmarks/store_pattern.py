"""Write throughput of the deterministic backward's partial-row pattern, no compute.

Each persistent program (one per SM) writes [64 slots, 512] fp32 blocks (128 KB) of its
tiles, as the main kernel does: block (tile, j) at offset (tile * nb + j) * 128 KB.
Compares with programs writing consecutive blocks (round-robin over the buffer), with
and without the streaming hint, and with torch's fill_.

    python benchmarks/store_pattern.py [--nb 10 --tiles 528]   # defaults: one H64 K640 chunk
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from bench import bench  # noqa: E402


@triton.jit
def _write(OUT, n_tiles, nb, TILE_MAJOR: tl.constexpr, CS: tl.constexpr, W: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_r = tl.arange(0, 64)
    offs_d = tl.arange(0, W)
    val = tl.full([64, W], 1.0, tl.float32) + pid
    n_blocks = n_tiles * nb
    for it in range(pid, n_blocks, nprog):
        if TILE_MAJOR:  # program walks its tiles' blocks j = 0..nb-1 (main kernel)
            k = it // nprog  # round of this program
            tile = pid + (k // nb) * nprog
            b = tile * nb + k % nb
        else:
            b = it
        base = OUT + b.to(tl.int64) * (64 * 512) + offs_r[:, None] * 512 + offs_d[None, :]
        for c in tl.static_range(512 // W):
            if CS:
                tl.store(base + c * W, val, cache_modifier=".cs")
            else:
                tl.store(base + c * W, val)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nb", type=int, default=10, help="64-slot blocks a tile")
    ap.add_argument("--tiles", type=int, default=528)
    a = ap.parse_args()
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    nb, n_tiles = a.nb, a.tiles
    out = torch.empty(n_tiles * nb * 64 * 512, dtype=torch.float32, device="cuda")
    gb = out.numel() * 4 / 1e9
    for tm in (True, False):
        for cs in (False, True):
            for w, nw in ((64, 4), (128, 4), (128, 8)):
                for progs in (sm, 2 * sm):
                    f = lambda: _write[(progs,)](out, n_tiles, nb, TILE_MAJOR=tm, CS=cs, W=w, num_warps=nw)
                    ms = bench(f)
                    print(f"tile_major={tm} cs={cs} W={w} warps={nw} programs={progs}: {ms:.3f} ms, "
                          f"{gb / ms:.2f} TB/s", flush=True)
    ms = bench(lambda: out.fill_(1.0))
    print(f"torch fill_: {ms:.3f} ms, {gb / ms:.2f} TB/s")


if __name__ == "__main__":
    main()
