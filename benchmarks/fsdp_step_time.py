"""FSDP2 step time, one GPU against two: the model of tests/test_fsdp.py at a larger size.

    PYTHONPATH=src python benchmarks/fsdp_step_time.py [--compile] [--ac full]

Each row of the table is a fresh run in its own processes (torch.multiprocessing.spawn,
one per GPU, NCCL; the one-GPU row is world_size 1): residual sparse-MLA layers (x +
``SparseMLAAttention``(x), bias on, sink drawn from N(0, 1): the layers of
tests/test_fsdp.py, rebuilt here on the public API), each wrapped in activation
checkpointing and ``fully_shard`` with bf16 parameters and fp32 gradient reduction
(optionally ``torch.compile``-d first, as the tests do), SGD with momentum. A step is
zero_grad + forward + loss + backward + optimizer step, timed between two
``torch.cuda.synchronize()``; the first ``--warmup`` steps (the compilation, the Triton
autotuning) are left out; the mean is the slowest rank's.
tokens/s = global batch * seq / mean step time. Each rank draws its own random batch
(global batch / GPUs samples; ids from ``dsv4_sparse_attn.testing.causal_indices``) once
and reuses it.

Default rows: 1 GPU and 2 GPUs at the same global batch (strong scaling), and 2 GPUs at
twice the batch (the same per-GPU work as the 1-GPU row: weak scaling).
``--device cpu`` runs the same code on gloo (a smoke test of the script; the times mean
nothing).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.checkpoint as cp
from torch import nn

from dsv4_sparse_attn import SparseMLAAttention, checkpoint_contexts
from dsv4_sparse_attn.testing import causal_indices

# No NVLink SHARP / multicast on the lent machines: set here, so the spawned workers
# inherit it, and again in each worker before NCCL starts.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
os.environ.update(NCCL_ENV)


class Layer(nn.Module):
    """x + attention(x): a residual attention layer."""

    def __init__(self, dim, n_heads, head_dim):
        super().__init__()
        self.attn = SparseMLAAttention(dim, n_heads, head_dim, bias=True)
        with torch.no_grad():
            self.attn.attn_sink.normal_()

    def forward(self, x, idx):
        return x + self.attn(x, idx)


class Checkpointed(nn.Module):
    """Activation checkpointing around ``inner``: "none", "full" (recompute everything) or
    "selective" (dsv4's policy: keep the attention's outputs, recompute the rest).
    ``fully_shard`` goes on this wrapper, so FSDP's all-gathers stay outside the
    checkpointed region."""

    def __init__(self, inner: nn.Module, mode: str):
        super().__init__()
        self.inner, self.mode = inner, mode

    def forward(self, x, idx):
        if self.mode == "none":
            return self.inner(x, idx)
        kw = {"context_fn": checkpoint_contexts()} if self.mode == "selective" else {}
        return cp.checkpoint(self.inner, x, idx, use_reentrant=False, **kw)


class Model(nn.Module):
    def __init__(self, dim, n_heads, head_dim, mode, n_layers=2):
        super().__init__()
        self.layers = nn.ModuleList(
            Checkpointed(Layer(dim, n_heads, head_dim), mode) for _ in range(n_layers))

    def forward(self, x, idx):
        for layer in self.layers:
            x = layer(x, idx)
        return x


def _loss(y, target):
    return (y.float() - target).square().mean()


def _compile_layers(model: Model) -> None:
    """Each layer becomes ``torch.compile(layer, fullgraph=True)`` before ``fully_shard``
    (as torchtitan does): FSDP2's hooks stay eager around the compiled call."""
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, fullgraph=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(worker, args, nprocs: int, timeout_s: float, what: str) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes and wait for them: a
    worker's exception is raised with its traceback, a hang raises TimeoutError after
    ``timeout_s``, and no worker outlives this call."""
    ctx = mp.spawn(worker, args=args, nprocs=nprocs, join=False)  # start method "spawn"
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=5):  # raises as soon as a worker fails
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} workers did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _worker(rank: int, world_size: int, port: int, global_batch: int, a: dict, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.update(NCCL_ENV)
    device = a["device"]
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        kw = {"device_id": torch.device("cuda", rank)}
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        kw = {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300), **kw)
    try:
        torch.manual_seed(0)  # the same initial model on every rank
        model = Model(a["dim"], a["heads"], a["head_dim"], a["ac"], n_layers=a["layers"]).to(device)
        if a["compile"]:
            _compile_layers(model)
        mesh = init_device_mesh(device, (world_size,))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        per_rank = global_batch // world_size
        S, K = a["seq"], a["topk"]
        g = torch.Generator(device=device).manual_seed(1234 + rank)
        x = torch.randn(per_rank, S, a["dim"], device=device, generator=g)
        target = torch.randn(per_rank, S, a["dim"], device=device, generator=g)
        idx = causal_indices((per_rank, S), K, a["window"], device=device, generator=g)

        def sync():
            if cuda:
                torch.cuda.synchronize()

        times = []
        for step in range(a["warmup"] + a["steps"]):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = _loss(model(x, idx), target)
            loss.backward()
            opt.step()
            sync()
            if step >= a["warmup"]:
                times.append(time.perf_counter() - t0)
        if not torch.isfinite(loss).item():
            raise RuntimeError(f"rank {rank}: loss is {loss.item()}")
        stats = torch.tensor([sum(times) / len(times),
                              torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0],
                             dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank, the fullest GPU
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"step_s": stats[0].item(), "peak_gib": stats[1].item(),
                           "name": torch.cuda.get_device_name() if cuda else "cpu"}, f)
    finally:
        dist.destroy_process_group()


def run(gpus: int, global_batch: int, a: dict, timeout_s: float) -> dict:
    """One row: ``gpus`` spawned workers; fails (with the worker's traceback) if one does,
    and leaves none running."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        run_workers(_worker, (gpus, _free_port(), global_batch, a, out), gpus, timeout_s, f"{gpus}-GPU run")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="1:8,2:8,2:16",
                    help="comma-separated GPUS:GLOBAL_BATCH rows (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ac", choices=("none", "full", "selective"), default="selective",
                    help="activation checkpointing of each layer (default: %(default)s)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each layer before fully_shard")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=420, help="seconds per row")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: gloo smoke test of the script (the times mean nothing)")
    args = ap.parse_args()
    a = vars(args).copy()
    rows = [tuple(int(v) for v in r.split(":")) for r in args.runs.split(",")]
    for gpus, batch in rows:
        if batch % gpus:
            ap.error(f"global batch {batch} does not split over {gpus} GPUs")
    if args.device == "cuda" and torch.cuda.device_count() < max(g for g, _ in rows):
        sys.exit(f"needs {max(g for g, _ in rows)} CUDA GPUs, found {torch.cuda.device_count()}")

    print(f"torch {torch.__version__}; dim {args.dim}, H {args.heads}, D {args.head_dim}, "
          f"seq {args.seq}, K {args.topk} (window {args.window}), {args.layers} layers, "
          f"AC {args.ac}, compile {args.compile}, bf16 params / fp32 reduce, "
          f"mean of {args.steps} steps after {args.warmup}", flush=True)
    results = []
    for gpus, batch in rows:
        r = run(gpus, batch, a, args.timeout)
        results.append((gpus, batch, r))
        print(f"  {gpus} GPU(s), global batch {batch}: {1e3 * r['step_s']:.2f} ms ({r['name']})",
              flush=True)
    print()
    print("| GPUs | global batch | mean step ms | tokens/s | peak GiB/GPU |")
    print("|---:|---:|---:|---:|---:|")
    for gpus, batch, r in results:
        print(f"| {gpus} | {batch} | {1e3 * r['step_s']:.2f} | {batch * args.seq / r['step_s']:,.0f} "
              f"| {r['peak_gib']:.2f} |")


if __name__ == "__main__":
    main()
