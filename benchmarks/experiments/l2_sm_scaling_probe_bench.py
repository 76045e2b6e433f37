"""Is the fast mode's rate bound per SM or by the whole L2? The probe of
``l2_mix_probe_bench.py`` (a block: 64 gathered kv rows, 64 KB of bf16 reads, and 64 rows x
512 fp32 of 16-byte reductions, 128 KB) from S SMs only, one program an SM of 16 warps, 310
blocks an SM (a T = 4096, H64 K640 call's share):

    PYTHONPATH=src:benchmarks/experiments python benchmarks/experiments/l2_sm_scaling_probe_bench.py

Question (docs/performance/backward.md#the-fast-modes-floor-probed): the last tiles of the fast
mode, run with most SMs idle, take a median tile's time, which reads as a bound within the
SM; the probe's 45.8 ns a block over 132 SMs reads as the L2's. If the L2 bounds it, a block
takes about S / 132 of its 132-SM time on S SMs (down to the SM's own limit); if the SM does,
the time a block stays flat as S falls.
"""
import json
import os

import torch
import triton

from l2_mix_probe_bench import _RED, _probe

dev = "cuda"
SMS = [int(s) for s in os.environ.get("PROBE_SMS", "132,66,33,16,8").split(",")]
BLOCKS_PER_SM = 310


def main():
    from triton.testing import do_bench
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    for R in (5120, 163840):  # accumulator and kv rows: L2-resident (T = 4096) or not
        acc = torch.zeros((R, 512), dtype=torch.float32, device=dev)
        kv = torch.randn((R, 512), device=dev).to(torch.bfloat16)
        for S in SMS:
            n_blocks = BLOCKS_PER_SM * S
            rows_t = torch.randint(0, R, (n_blocks * 64,), device=dev, dtype=torch.int32)
            sink = torch.empty((S, 128), dtype=torch.float32, device=dev)
            arms = (("reads", True, False), ("reductions", False, True), ("both", True, True))
            for name, read, red in arms:
                def f(read=read, red=red):
                    _probe[(S,)](acc, kv, rows_t, sink, n_blocks, READ=read, RED=red, ASM=_RED[0],
                                 CONS=_RED[1], num_warps=16)
                f()
                ms = do_bench(f, warmup=5, rep=40)
                bytes_a_row = (1024 if read else 0) + (2048 if red else 0)
                print(json.dumps(dict(rows=R, sms=S, arm=name, ms=round(ms, 4),
                                      us_a_block_an_sm=round(ms * 1e3 / BLOCKS_PER_SM, 3),
                                      ns_a_block_over_gpu=round(ms * 1e6 / n_blocks, 2),
                                      GBps_an_sm=round(BLOCKS_PER_SM * 64 * bytes_a_row / ms / 1e6, 1))),
                      flush=True)
        acc = kv = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
