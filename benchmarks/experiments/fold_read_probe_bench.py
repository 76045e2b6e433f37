"""How fast can a few SMs read the deterministic fold's partial rows? The fold reads 1 KB
row pieces (256 fp32 columns) at scattered rows; beside the main kernel it had 16-32 SMs
and read about 24 GB/s an SM (docs/performance/backward.md#the-fold-beside-the-main-kernel-not-kept).
This probe reads random 1 KB row pieces of a 5.4 GB fp32 buffer (H64 K640's partial rows at
T = 4096) from a persistent grid of P programs, summing them, three ways:

- ``ptr``: pointer loads, ROWS rows a step (the fold's way);
- ``tma``: each row piece by a TMA tensor load (``desc.load``: a [1, 256] box at the row),
  ROWS a step, the loop pipelined over ``num_stages`` steps;
- ``ptr`` with the steps pipelined the same way (``num_stages``), for comparison.

    PYTHONPATH=src python benchmarks/experiments/fold_read_probe_bench.py

Prediction: pointer loads at 20-30 GB/s an SM however many programs (what the fold does);
TMA loads several times that, since a program keeps many boxes in flight without a
register for each; the design needs about 130 GB/s an SM on 16 SMs (2.1 TB/s).
"""
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

dev = "cuda"


@triton.jit
def _ptr_probe(BUF, ROWS_IDX, OUT, n_steps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
               STAGES: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_D)
    r = tl.arange(0, ROWS)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in tl.range(pid, n_steps, tl.num_programs(0), num_stages=STAGES):
        rows = tl.load(ROWS_IDX + s * ROWS + r).to(tl.int64)
        x = tl.load(BUF + rows[:, None] * BLOCK_D + c[None, :])
        acc += tl.sum(x, 0)
    tl.store(OUT + pid * BLOCK_D + c, acc)


@triton.jit
def _tma_probe(desc, ROWS_IDX, OUT, n_steps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
               STAGES: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in tl.range(pid, n_steps, tl.num_programs(0), num_stages=STAGES):
        for i in tl.static_range(ROWS):
            row = tl.load(ROWS_IDX + s * ROWS + i)
            acc += tl.sum(desc.load([row, 0]), 0)
    tl.store(OUT + pid * BLOCK_D + c, acc)


def main():
    from triton.testing import do_bench
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    BLOCK_D = 256
    n_rows = 5 * 2**20  # 5.4 GB of fp32 row pieces
    buf = torch.randn(n_rows, BLOCK_D, device=dev)
    desc = TensorDescriptor.from_tensor(buf, [1, BLOCK_D])
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(n_sm * 4, BLOCK_D, device=dev)
    for P in (16, 32, n_sm):
        for ROWS in (8, 32):
            n_steps = P * 400  # 400 steps a program
            idx = torch.randint(0, n_rows, (n_steps * ROWS,), device=dev, dtype=torch.int32)
            nbytes = n_steps * ROWS * BLOCK_D * 4
            for kind in ("ptr", "tma"):
                for stages in (1, 3):
                    for warps in (4, 8):
                        def f():
                            if kind == "ptr":
                                _ptr_probe[(P,)](buf, idx, out, n_steps, ROWS=ROWS, BLOCK_D=BLOCK_D,
                                                 STAGES=stages, num_warps=warps)
                            else:
                                _tma_probe[(P,)](desc, idx, out, n_steps, ROWS=ROWS, BLOCK_D=BLOCK_D,
                                                 STAGES=stages, num_warps=warps)
                        r = dict(programs=P, rows_a_step=ROWS, kind=kind, stages=stages, warps=warps)
                        try:
                            f()
                            ms = do_bench(f, warmup=3, rep=30)
                            r.update(ms=round(ms, 4), TBps=round(nbytes / ms / 1e9, 3),
                                     GBps_a_program=round(nbytes / ms / 1e6 / P, 1))
                        except Exception as e:  # noqa: BLE001
                            r["error"] = str(e)[:200]
                        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
