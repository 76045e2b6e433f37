"""FSDP2 (``fully_shard``) with bf16 mixed precision and activation checkpointing (full and
selective): three optimizer steps match an unsharded reference model trained the same way.

CPU: gloo, two processes (torch.multiprocessing.spawn), D=16 (the CPU runs the reference);
     and gloo in one process (world_size 1), the code path of the GPU test.
GPU: NCCL, one process (world_size 1), bf16 with D=128 so the Triton kernels run.

How the reference is trained: FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` keeps fp32 sharded parameters, computes forward and backward with
their bf16 casts, casts each rank's bf16 gradients to fp32, averages them over the ranks
and steps in fp32. The reference does the same arithmetic without sharding: one fp32
model, a forward through ``torch.func.functional_call`` with its parameters cast to bf16
(the cast is differentiable, so gradients come back in fp32), one backward per rank's
part of the batch with the loss divided by world_size (1 or 2: exact), and the same
optimizer in fp32. SGD with momentum: it is linear in the gradients, so a last-bit
difference in a gradient stays a last-bit difference in the parameters (Adam's first
steps move every element by about lr * sign(grad), which turns a one-ulp difference in a
near-zero gradient into a 2 * lr one).

Each rank gets its own half of the global batch (rather than the same batch), so the
gradient averaging of data parallelism is part of what is checked. The reference runs
without checkpointing: recomputation must not change a value.
"""
from __future__ import annotations

import copy
import datetime
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.checkpoint as cp
from torch import nn

from dsv4_sparse_attn import SparseMLAAttention, checkpoint_contexts, reference
from dsv4_sparse_attn.kernels import dispatch
from helpers import causal_indices, relerr

STEPS = 3
TIMEOUT_S = 240

# (dim, H, D, samples per rank, S, K, window, tolerance on relerr)
# CPU tolerance: the same bf16 ops on the same values, and the average of two fp32
# gradients is exact whether the reduce-scatter or autograd adds them: observed bitwise
# equal (relerr 0); 1e-6 leaves room for a summation order only. (A reference computing
# in fp32 instead of bf16 is off by ~2e-2 in the gradients: the check has teeth.)
# GPU tolerance: cuBLAS may pick other bf16 GEMM kernels for FSDP's all-gathered parameters
# (other alignment inside the flat buffer) than for the reference's casts: one bf16
# rounding apart (2^-8 = 4e-3) per op, compounded over 2 layers and 3 steps: 2e-2.
CONFIGS = {
    "cpu": (32, 4, 16, 2, 12, 8, 4, 1e-6),
    "cuda": (256, 8, 128, 2, 128, 48, 16, 2e-2),
}


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
    """Activation checkpointing around ``inner`` (what torchtitan's checkpoint_wrapper does).

    mode: "none", "full" (recompute everything) or "selective" (dsv4's SAC policy).
    ``fully_shard`` goes on this wrapper, so FSDP's all-gather hooks stay outside the
    checkpointed region.
    """

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


def _batch(step, world_size, device, dim, per_rank, S, K, window):
    """The global batch of one step (same on every rank): [world_size * per_rank, S, ...]."""
    g = torch.Generator().manual_seed(1000 + step)
    B = world_size * per_rank
    x = torch.randn(B, S, dim, generator=g)
    target = torch.randn(B, S, dim, generator=g)
    idx = causal_indices((B, S), K, window, generator=g)
    return x.to(device), idx.to(device), target.to(device)


def _count_forward_calls(device):
    """Wrap the forward implementation the op calls on ``device`` (module attributes, as
    ops.py calls them); returns the list that grows by one per call and an undo function."""
    mod, name = (reference, "sparse_mla_fwd") if device == "cpu" else (dispatch, "forward")
    real = getattr(mod, name)
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    setattr(mod, name, spy)
    return calls, lambda: setattr(mod, name, real)


def train_and_compare(rank: int, world_size: int, device: str) -> None:
    """Train FSDP2 and reference models side by side for each checkpointing mode; assert
    losses, gradients and parameters agree. Needs an initialised default process group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dim, n_heads, head_dim, per_rank, S, K, window, tol = CONFIGS[device]
    bf16 = torch.bfloat16
    mp_policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
    # An explicit mesh: without one fully_shard places shards on the current accelerator,
    # which would move the "cpu" run to the GPU on a machine that has one.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world_size,))
    for mode in ("full", "selective"):
        torch.manual_seed(0)  # the same initial model on every rank
        model = Model(dim, n_heads, head_dim, mode).to(device)
        ref = copy.deepcopy(model)
        for layer in ref.layers:
            layer.mode = "none"
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        ref_params = dict(ref.named_parameters())
        assert list(ref_params) == [n for n, _ in model.named_parameters()]
        initial = {n: p.detach().clone() for n, p in ref_params.items()}

        for step in range(STEPS):
            x, idx, target = _batch(step, world_size, device, dim, per_rank, S, K, window)
            mine = slice(rank * per_rank, (rank + 1) * per_rank)

            calls, undo = _count_forward_calls(device)
            try:
                opt.zero_grad(set_to_none=True)
                y = model(x[mine], idx[mine])
                assert y.dtype == bf16  # the bf16 compute really happened
                loss = _loss(y, target[mine])
                loss.backward()
            finally:
                undo()
            # 2 layers: full checkpointing runs each layer's attention twice, SAC once.
            assert len(calls) == (4 if mode == "full" else 2), (mode, len(calls))

            ref_opt.zero_grad(set_to_none=True)
            bf16_params = {n: p.to(bf16) for n, p in ref.named_parameters()}
            ref_losses = []
            for r in range(world_size):
                part = slice(r * per_rank, (r + 1) * per_rank)
                y_ref = torch.func.functional_call(ref, bf16_params, (x[part].to(bf16), idx[part]))
                ref_loss = _loss(y_ref, target[part])
                (ref_loss / world_size).backward(retain_graph=r < world_size - 1)
                ref_losses.append(ref_loss.detach())

            assert relerr(loss, ref_losses[rank]) < tol, (mode, step, rank)
            for name, p in model.named_parameters():
                grad = p.grad.full_tensor()  # a collective: every rank, same order
                ref_grad = ref_params[name].grad
                assert grad.dtype == torch.float32 and grad.shape == ref_grad.shape
                assert relerr(grad, ref_grad) < tol, (mode, step, name, relerr(grad, ref_grad))
            opt.step()
            ref_opt.step()

        for name, p in model.named_parameters():
            full = p.full_tensor()
            assert full.dtype == torch.float32
            assert relerr(full, ref_params[name]) < tol, (mode, name)
            # Every parameter moved (the sink's gradient is small: compare bits, not a norm).
            assert not torch.equal(ref_params[name], initial[name]), f"{name} did not train"
        dist.barrier()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)  # two processes on a small CPU
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        train_and_compare(rank, world_size, "cpu")
    finally:
        dist.destroy_process_group()


def test_fsdp2_gloo_two_processes():
    world_size, port = 2, _free_port()
    ctx = mp.spawn(_gloo_worker, args=(world_size, port), nprocs=world_size, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    # join() raises (with the worker's traceback) as soon as a worker fails.
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"FSDP2 gloo workers did not finish within {TIMEOUT_S} s")


@pytest.mark.parametrize("backend", [
    "gloo",
    pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL, Triton kernels)")]),
])
def test_fsdp2_one_process(backend, tmp_path, monkeypatch):
    """world_size 1 in this process: gloo on the CPU, NCCL on the GPU."""
    device = "cuda" if backend == "nccl" else "cpu"
    kw = {}
    if backend == "nccl":
        # No NVLink SHARP / multicast on the lent machines.
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
        monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(0)
        kw["device_id"] = torch.device("cuda", 0)
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120), **kw)
    try:
        train_and_compare(0, 1, device)
        if device == "cuda":
            torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
