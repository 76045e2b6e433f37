"""Selective activation checkpointing: the policy saves the sparse-MLA forward (CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as cp
from torch.utils.checkpoint import CheckpointPolicy

import dsv4_sparse_attn
from dsv4_sparse_attn import SparseMLAAttention, checkpoint_contexts, reference, sac_policy
from helpers import relerr

DIM, H, D = 16, 4, 8


@pytest.fixture
def fwd_calls(monkeypatch):
    """Count calls of the CPU forward implementation.

    The CPU kernel of both dsv4 forward ops calls ``reference.sparse_mla_fwd`` through
    the module attribute (ops.py: ``reference.sparse_mla_fwd(...)``), so patching the
    attribute sees every forward; the backward (``reference.sparse_mla_bwd``) does not call it.
    """
    calls = []
    real = reference.sparse_mla_fwd

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "sparse_mla_fwd", spy)
    return calls


def _block_and_inputs(seed, batched=False):
    torch.manual_seed(seed)
    block = SparseMLAAttention(DIM, H, D, bias=True)
    with torch.no_grad():
        block.attn_sink.normal_()
    if batched:
        x = torch.randn(2, 7, DIM)
        idx = torch.randint(-1, 8, (2, 7, 5))
    else:
        x = torch.randn(9, DIM)
        idx = torch.randint(-1, 10, (9, 5))
    return block, x.requires_grad_(True), idx


def _run(block, x, idx, mode):
    """Forward + backward of two stacked calls of the block; returns loss and all grads."""
    block.zero_grad(set_to_none=True)
    x.grad = None

    def layer(h):
        return h + block(h, idx)

    if mode == "none":
        fn = layer
    elif mode == "full":
        def fn(h):
            return cp.checkpoint(layer, h, use_reentrant=False)
    else:
        def fn(h):
            return cp.checkpoint(layer, h, use_reentrant=False, context_fn=checkpoint_contexts())
    y = fn(fn(x))
    loss = y.square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    grads["x"] = x.grad.clone()
    return loss.detach(), grads


@pytest.mark.parametrize("batched", [False, True], ids=["flat", "batched"])
def test_policy_saves_the_attention_forward(fwd_calls, batched):
    block, x, idx = _block_and_inputs(0, batched)
    loss0, g0 = _run(block, x, idx, "none")
    assert len(fwd_calls) == 2  # two layers, one forward each
    fwd_calls.clear()
    loss1, g1 = _run(block, x, idx, "full")
    assert len(fwd_calls) == 4, "plain checkpointing reruns every forward in the backward"
    fwd_calls.clear()
    loss2, g2 = _run(block, x, idx, "sac")
    assert len(fwd_calls) == 2, "the policy must save sparse_mla's outputs, not recompute them"
    assert torch.equal(loss1, loss0) and torch.equal(loss2, loss0)
    assert g0.keys() == g1.keys() == g2.keys()
    for name in g0:
        # Same ops on the same values: equal up to fp32 summation order of autograd.
        assert relerr(g1[name], g0[name]) < 1e-6, name
        assert relerr(g2[name], g0[name]) < 1e-6, name


def test_policy_decisions():
    policy = sac_policy()
    assert policy(None, torch.ops.dsv4.sparse_mla.default) is CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.dsv4.sparse_mla_fwd.default) is CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.mm.default) is CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, torch.ops.dsv4.sparse_mla_bwd.default) is CheckpointPolicy.PREFER_RECOMPUTE
    more = sac_policy(also_save=[torch.ops.aten.mm.default])
    assert more(None, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert more(None, torch.ops.dsv4.sparse_mla.default) is CheckpointPolicy.MUST_SAVE


def test_sparse_mla_fwd_op_is_saved_too(fwd_calls):
    """Users composing their own autograd with dsv4::sparse_mla_fwd get it saved as well."""
    torch.manual_seed(1)
    q = torch.randn(6, H, D, requires_grad=True)
    kv = torch.randn(8, D, requires_grad=True)
    idx = torch.randint(-1, 9, (6, 4))

    def f(q, kv):
        out, lse = torch.ops.dsv4.sparse_mla_fwd(q.sin(), kv.cos(), idx)
        return out.square().sum() + lse.sum()

    want = torch.autograd.grad(f(q, kv), (q, kv))
    fwd_calls.clear()
    got = torch.autograd.grad(
        cp.checkpoint(f, q, kv, use_reentrant=False, context_fn=checkpoint_contexts()), (q, kv))
    assert len(fwd_calls) == 1
    for g, w in zip(got, want):
        assert relerr(g, w) < 1e-6


def test_policy_under_torch_compile(fwd_calls):
    """The policy inside a compiled function (aot_eager: the real ops run, so calls are counted)."""
    torch._dynamo.reset()
    block, x, idx = _block_and_inputs(2)

    def step(x):
        y = cp.checkpoint(block, x, idx, use_reentrant=False, context_fn=checkpoint_contexts())
        return y.square().mean()

    loss_e = step(x)
    g_e = torch.autograd.grad(loss_e, [x, *block.parameters()])
    fwd_calls.clear()
    loss_c = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    g_c = torch.autograd.grad(loss_c, [x, *block.parameters()])
    assert len(fwd_calls) == 1, fwd_calls
    assert relerr(loss_c, loss_e) < 1e-6
    for g, w in zip(g_c, g_e):
        assert relerr(g, w) < 1e-6


def test_public_names():
    assert dsv4_sparse_attn.sac_policy is sac_policy
    assert dsv4_sparse_attn.checkpoint_contexts is checkpoint_contexts
    assert {"sac_policy", "checkpoint_contexts", "SparseMLAAttention"} <= set(dsv4_sparse_attn.__all__)
