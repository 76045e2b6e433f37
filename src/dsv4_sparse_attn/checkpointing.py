"""Selective activation checkpointing (SAC): save the attention, recompute the rest.

Plain activation checkpointing (``torch.utils.checkpoint.checkpoint``) reruns the whole
region in the backward, the sparse-MLA forward included: the most expensive op of the
layer then runs twice per step. The policy here marks the dsv4 forward ops
``MUST_SAVE`` (their ``out`` [T, H, D] and ``lse`` [T, H] are kept, which is all the
backward needs from them) and everything else ``PREFER_RECOMPUTE`` (projections,
norms, elementwise ops: cheap to redo, and their activations are what checkpointing
is meant to drop).

    import torch.utils.checkpoint as cp
    from dsv4_sparse_attn import checkpoint_contexts

    y = cp.checkpoint(block, x, indices, use_reentrant=False, context_fn=checkpoint_contexts())

With FSDP2 or torchtitan-style wrappers, pass the same ``context_fn`` to
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper``
(``checkpoint_wrapper(block, context_fn=checkpoint_contexts())``). The policy works
under ``torch.compile`` too (``MUST_SAVE`` is not overridden by the compiler).
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import ops  # noqa: F401  (registers torch.ops.dsv4.*)


def default_save_ops() -> tuple:
    """The dsv4 ops whose outputs the policy saves: the two differentiable forwards."""
    return (torch.ops.dsv4.sparse_mla.default, torch.ops.dsv4.sparse_mla_fwd.default)


def sac_policy(also_save: Iterable = ()) -> Callable:
    """A policy function for ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

    It returns ``CheckpointPolicy.MUST_SAVE`` for ``torch.ops.dsv4.sparse_mla.default``,
    ``torch.ops.dsv4.sparse_mla_fwd.default`` and the ops in ``also_save`` (OpOverloads,
    e.g. ``torch.ops.aten.mm.default`` to keep the projections too), and
    ``CheckpointPolicy.PREFER_RECOMPUTE`` for every other op.
    """
    save = frozenset(default_save_ops()) | frozenset(also_save)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_contexts(also_save: Iterable = ()) -> Callable:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
    ``functools.partial(create_selective_checkpoint_contexts, sac_policy(also_save))``."""
    return functools.partial(create_selective_checkpoint_contexts, sac_policy(also_save))


__all__ = ["sac_policy", "checkpoint_contexts", "default_save_ops"]
