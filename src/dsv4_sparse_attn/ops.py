"""torch.library registration of the ``dsv4`` ops: schemas, fake kernels, autograd, devices.

    dsv4::sparse_mla_fwd(q, kv, indices, attn_sink=None, scale=None, topk_length=None, d_v=None)
        -> (out, lse)
    dsv4::sparse_mla_bwd(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink=None, scale=None,
                         topk_length=None, d_v=None) -> (grad_q, grad_kv, grad_sink)
    dsv4::sparse_mla(q, kv, indices, attn_sink=None, scale=None, topk_length=None, d_v=None)
        -> (out, lse)

``topk_length`` (int32 [T]): slot j of token t is masked when j >= topk_length[t].
``d_v``: values are kv[:, :d_v] (default D; the DeepSeek-V3.2 / GLM-5 layout scores 576
columns and takes the first 512 as values): out and grad_out are [T, H, d_v].

``sparse_mla`` and ``sparse_mla_fwd`` compute the same thing and are both
differentiable (in q, kv and attn_sink, through out and lse); their backward
calls ``sparse_mla_bwd``. ``sparse_mla`` is the op models call; ``sparse_mla_fwd``
is the forward building block (for users composing their own autograd and for
selective activation checkpointing policies). ``sparse_mla_bwd`` has no double
backward and says so.

CPU tensors run the exact PyTorch reference; CUDA tensors run the kernel that
``kernels/dispatch.py`` chooses (Gluon, Triton, or the reference for calls no kernel takes).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import reference
from .kernels import dispatch
from .validation import check_backward, check_forward, kv_rows, lse_dtype


# The dispatcher drops trailing arguments equal to their schema defaults before it
# calls a registered kernel, so every kernel below repeats the defaults.

# --------------------------------------------------------------------------- forward
def _fwd_cpu(q, kv, indices, attn_sink=None, scale=None, topk_length=None, d_v=None):
    p = check_forward(q, kv, indices, attn_sink, scale, topk_length, d_v)
    return reference.sparse_mla_fwd(q, kv_rows(kv), indices, attn_sink, p.scale, topk_length, p.d_v)


def _fwd_cuda(q, kv, indices, attn_sink=None, scale=None, topk_length=None, d_v=None):
    p = check_forward(q, kv, indices, attn_sink, scale, topk_length, d_v)
    return dispatch.forward(q, kv_rows(kv), indices, attn_sink, p, topk_length)


def _fwd_fake(q, kv, indices, attn_sink=None, scale=None, topk_length=None, d_v=None):
    p = check_forward(q, kv, indices, attn_sink, scale, topk_length, d_v)
    out = q.new_empty((p.T, p.H, p.d_v))
    lse = q.new_empty((p.T, p.H), dtype=lse_dtype(q))
    return out, lse


@torch.library.custom_op("dsv4::sparse_mla_fwd", mutates_args=(), device_types="cpu")
def sparse_mla_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    attn_sink: Optional[Tensor] = None,
    scale: Optional[float] = None,
    topk_length: Optional[Tensor] = None,
    d_v: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Sparse-MLA forward: out [T, H, d_v] in q's dtype and the sink-inclusive lse [T, H] fp32."""
    return _fwd_cpu(q, kv, indices, attn_sink, scale, topk_length, d_v)


@torch.library.custom_op("dsv4::sparse_mla", mutates_args=(), device_types="cpu")
def sparse_mla(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    attn_sink: Optional[Tensor] = None,
    scale: Optional[float] = None,
    topk_length: Optional[Tensor] = None,
    d_v: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Differentiable sparse-MLA attention: (out, lse), gradients through both."""
    return _fwd_cpu(q, kv, indices, attn_sink, scale, topk_length, d_v)


for _op in (sparse_mla_fwd, sparse_mla):
    _op.register_kernel("cuda")(_fwd_cuda)
    _op.register_fake(_fwd_fake)


# --------------------------------------------------------------------------- backward
def _bwd_cpu(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink=None, scale=None, topk_length=None,
             d_v=None):
    p = check_backward(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, scale, topk_length, d_v)
    dq, dkv, dsink = reference.sparse_mla_bwd(
        grad_out, grad_lse, q, kv_rows(kv), out, lse, indices, attn_sink, p.scale, topk_length, p.d_v
    )
    return dq, dkv.view(kv.shape), dsink


def _bwd_cuda(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink=None, scale=None, topk_length=None,
              d_v=None):
    p = check_backward(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, scale, topk_length, d_v)
    dq, dkv, dsink = dispatch.backward(
        grad_out, grad_lse, q, kv_rows(kv), out, lse, indices, attn_sink, p, topk_length
    )
    return dq, dkv.view(kv.shape), dsink


def _bwd_fake(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink=None, scale=None, topk_length=None,
              d_v=None):
    p = check_backward(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, scale, topk_length, d_v)
    dq = q.new_empty((p.T, p.H, p.D))
    dkv = kv.new_empty(kv.shape)
    dsink = q.new_empty(
        (p.H if attn_sink is not None else 0,),
        dtype=attn_sink.dtype if attn_sink is not None else lse_dtype(q),
    )
    return dq, dkv, dsink


@torch.library.custom_op("dsv4::sparse_mla_bwd", mutates_args=(), device_types="cpu")
def sparse_mla_bwd(
    grad_out: Tensor,
    grad_lse: Optional[Tensor],
    q: Tensor,
    kv: Tensor,
    out: Tensor,
    lse: Tensor,
    indices: Tensor,
    attn_sink: Optional[Tensor] = None,
    scale: Optional[float] = None,
    topk_length: Optional[Tensor] = None,
    d_v: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Sparse-MLA backward: grad_q, grad_kv (kv's shape), grad_sink ([H] in the sink's dtype, or
    empty without sink).

    ``grad_lse`` may be None (treated as zero); a gradient on lse shifts Delta.
    """
    return _bwd_cpu(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, scale, topk_length, d_v)


sparse_mla_bwd.register_kernel("cuda")(_bwd_cuda)
sparse_mla_bwd.register_fake(_bwd_fake)


# --------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    q, kv, indices, attn_sink, scale, topk_length, d_v = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, indices, attn_sink, out, lse, topk_length)
    ctx.scale = scale
    ctx.d_v = d_v
    ctx.has_sink = attn_sink is not None


def _backward(ctx, grad_out, grad_lse):
    q, kv, indices, attn_sink, out, lse, topk_length = ctx.saved_tensors
    # Unused outputs arrive as zeros (autograd materialises them).
    dq, dkv, dsink = torch.ops.dsv4.sparse_mla_bwd(
        grad_out.to(q.dtype), grad_lse, q, kv, out, lse, indices, attn_sink, ctx.scale, topk_length, ctx.d_v
    )
    return dq, dkv, None, (dsink if ctx.has_sink else None), None, None, None


for _op in (sparse_mla_fwd, sparse_mla):
    _op.register_autograd(_backward, setup_context=_setup_context)


def _bwd_setup_context(ctx, inputs, output):
    pass


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "dsv4::sparse_mla_bwd is not differentiable (double backward of sparse_mla is not supported)"
    )


sparse_mla_bwd.register_autograd(_no_double_backward, setup_context=_bwd_setup_context)
