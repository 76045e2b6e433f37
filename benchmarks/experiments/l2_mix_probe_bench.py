"""Do the fast mode's gathers and its reductions share one L2 limit? Each 64-slot block of
the main kernel reads 64 gathered kv rows (64 KB of bf16) and adds 64 rows x 512 fp32 to
the accumulator (128 KB of 16-byte reductions). This probe sends the same two streams,
alone and together, from the same kernel:

    PYTHONPATH=src:benchmarks/experiments python benchmarks/experiments/l2_mix_probe_bench.py

Question (docs/performance/backward.md#gathers-and-reductions-share-the-l2-probed): ncu had both kernels' L2
at 76-79% of its peak throughput. If reads and reductions share that limit, the pair takes
about the sum of their times alone, and fewer gather bytes (one gather for both head blocks
of a token at H = 128) would shorten the fast mode; if they overlap, the time of the pair is
about the longer of the two and only fewer reduction bytes would.
"""
import json

import torch
import triton
import triton.language as tl

from red_probe_bench import _ASM  # (this directory): the fast mode's 16-byte reduction as PTX

dev = "cuda"
_RED = _ASM["f32x4 red"]


@triton.jit
def _probe(ACC, KV, ROWS, SINK, n_blocks, READ: tl.constexpr, RED: tl.constexpr, ASM: tl.constexpr,
           CONS: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.arange(0, 64)
    g = tl.arange(0, 128)  # 16-byte groups of a 512-column fp32 row
    c = tl.arange(0, 128)  # a 128-column quarter of a bf16 row
    keep = tl.zeros([128], tl.float32)
    for b in range(pid, n_blocks, tl.num_programs(0)):
        rows = tl.load(ROWS + b * 64 + r).to(tl.int64)
        if READ:  # the block's gather: 64 rows x 512 bf16, a quarter at a time
            for qq in tl.static_range(4):
                x = tl.load(KV + rows[:, None] * 512 + qq * 128 + c[None, :])
                keep += tl.sum(x.to(tl.float32), 0)
        if RED:  # the block's dKV rows: 64 x 512 fp32 by 16-byte reductions
            base = (ACC + rows[:, None] * 512 + g[None, :] * 4).to(tl.int64, bitcast=True)
            v = (r[:, None] + g[None, :]).to(tl.float32) * 1e-3
            tl.inline_asm_elementwise(ASM, CONS, [base, v, v + 1.0, v + 2.0, v + 3.0], dtype=tl.int32,
                                      is_pure=False, pack=1)
    tl.store(SINK + pid * 128 + c, keep)


def main():
    from triton.testing import do_bench
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    n_blocks = 4096 * 10
    n_prog = 132 * 4
    out = []
    for R in (5120, 163840):  # accumulator and kv rows: L2-resident (T = 4096) or not
        rows_t = torch.randint(0, R, (n_blocks * 64,), device=dev, dtype=torch.int32)
        acc = torch.zeros((R, 512), dtype=torch.float32, device=dev)
        kv = torch.randn((R, 512), device=dev).to(torch.bfloat16)
        sink = torch.empty((n_prog, 128), dtype=torch.float32, device=dev)
        res = {}
        for name, read, red in (("reads", True, False), ("reductions", False, True), ("both", True, True)):
            best = None
            for warps in (4, 8):
                def f(read=read, red=red, warps=warps):
                    _probe[(n_prog,)](acc, kv, rows_t, sink, n_blocks, READ=read, RED=red, ASM=_RED[0],
                                      CONS=_RED[1], num_warps=warps)
                f()
                ms = do_bench(f, warmup=5, rep=40)
                best = ms if best is None else min(best, ms)
            res[name] = best
            out.append(dict(rows=R, arm=name, ms=round(best, 4),
                            read_TBps=round(n_blocks * 64 * 1024 / best / 1e9, 2) if read else 0,
                            red_TBps=round(n_blocks * 64 * 2048 / best / 1e9, 2) if red else 0))
            print(json.dumps(out[-1]), flush=True)
        s, m = res["reads"] + res["reductions"], max(res["reads"], res["reductions"])
        print(json.dumps(dict(rows=R, both_ms=round(res["both"], 4), sum_ms=round(s, 4), max_ms=round(m, 4),
                              both_as_share_of_sum=round(res["both"] / s, 3))), flush=True)
        acc = kv = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
