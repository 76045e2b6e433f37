"""The Python API: flat and batched layouts on top of ``torch.ops.dsv4.sparse_mla``."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops  # noqa: F401  (registers torch.ops.dsv4.*)

_INT32_MAX = 2**31 - 1


def _flatten_batched(q: Tensor, kv: Tensor, indices: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """[B,S,H,D], [B,N,D], [B,S,K] with per-sample ids -> flat [B*S,H,D], [B*N,D], [B*S,K].

    Sample b's valid id i (0 <= i < N) becomes b*N + i; every other id stays masked (-1),
    so an id past the end of one sample never reads the next one. q is viewed, not copied.
    """
    if kv.dim() != 3:
        raise ValueError(
            f"sparse_mla: batched kv must have shape [B, N, D], got shape {list(kv.shape)}"
        )
    if indices.dim() != 3:
        raise ValueError(
            f"sparse_mla: batched indices must have shape [B, S, K], got shape {list(indices.shape)}"
        )
    B, S = q.shape[:2]
    if kv.shape[0] != B or indices.shape[0] != B or indices.shape[1] != S:
        raise ValueError(
            f"sparse_mla: batched shapes disagree: q {list(q.shape)} (B={B}, S={S}), "
            f"kv {list(kv.shape)}, indices {list(indices.shape)}"
        )
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"sparse_mla: indices must have dtype int32 or int64, got {indices.dtype}")
    N = kv.shape[1]
    idx_dtype = torch.int64 if B * N > _INT32_MAX else indices.dtype
    idx = indices.to(idx_dtype)
    offsets = (torch.arange(B, device=indices.device, dtype=idx_dtype) * N).view(B, 1, 1)
    valid = (idx >= 0) & (idx < N)
    flat_idx = torch.where(valid, idx + offsets, torch.full((), -1, dtype=idx_dtype, device=idx.device))
    return q.flatten(0, 1), kv.reshape(B * N, kv.shape[2]), flat_idx.flatten(0, 1)


def sparse_mla(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    attn_sink: Optional[Tensor] = None,
    scale: Optional[float] = None,
    *,
    return_lse: bool = False,
    topk_length: Optional[Tensor] = None,
    d_v: Optional[int] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """DeepSeek-V4 sparse-MLA attention, differentiable in q, kv and attn_sink.

    Flat layout:    q [T, H, D], kv [N, D] (or [N, 1, D]), indices [T, K] global row ids.
    Batched layout: q [B, S, H, D], kv [B, N, D], indices [B, S, K] per-sample row ids.

    Ids < 0 or >= N (per sample in the batched layout) are masked; duplicates count
    once per occurrence. ``attn_sink`` [H] fp32 joins the softmax denominator only;
    ``scale`` defaults to D**-0.5. Returns out in the caller's layout (q's dtype) and,
    with ``return_lse=True``, also the natural-log, sink-inclusive lse ([T, H] or
    [B, S, H], fp32), which is differentiable too.

    ``topk_length`` (int32 [T] or [B, S]): slot j of a token is masked when j >=
    topk_length (values above K act as K, below 0 as 0); the kernels skip those slots.
    ``d_v``: the values are kv[..., :d_v] (default D): the DeepSeek-V3.2 / GLM-5 layout
    scores q.k over 576 columns and takes the first 512 as values; out is then [..., d_v].
    """
    if not isinstance(q, Tensor):
        raise TypeError(f"sparse_mla: q must be a torch.Tensor, got {type(q).__name__}")
    # (the ops' schemas would take True as 1.0 and 1: a bool is a mistake, not a number)
    if isinstance(scale, bool):
        raise TypeError(f"sparse_mla: scale must be a float or None, got {type(scale).__name__}")
    if isinstance(d_v, bool):
        raise TypeError(f"sparse_mla: d_v must be an int or None, got {type(d_v).__name__}")
    if q.dim() == 4:
        B, S = q.shape[:2]
        fq, fkv, fidx = _flatten_batched(q, kv, indices)
        flen = None
        if topk_length is not None:
            if not isinstance(topk_length, Tensor) or topk_length.shape != (B, S):
                raise ValueError(f"sparse_mla: batched topk_length must have shape [B, S] = [{B}, {S}], "
                                 f"got {list(getattr(topk_length, 'shape', [type(topk_length).__name__]))}")
            flen = topk_length.reshape(B * S)
        out, lse = torch.ops.dsv4.sparse_mla(fq, fkv, fidx, attn_sink, scale, flen, d_v)
        out, lse = out.view(B, S, *out.shape[1:]), lse.view(B, S, lse.shape[1])
    elif q.dim() == 3:
        out, lse = torch.ops.dsv4.sparse_mla(q, kv, indices, attn_sink, scale, topk_length, d_v)
    else:
        raise ValueError(
            f"sparse_mla: q must have shape [T, H, D] (flat) or [B, S, H, D] (batched), "
            f"got shape {list(q.shape)}"
        )
    return (out, lse) if return_lse else out


def sparse_attn(
    q: Tensor, kv: Tensor, attn_sink: Optional[Tensor], topk_idxs: Tensor, softmax_scale: float,
    *, topk_length: Optional[Tensor] = None, d_v: Optional[int] = None,
) -> Tensor:
    """Drop-in for the DeepSeek-V4 reference ``sparse_attn`` (batched per-sample layout).

    q [B, S, H, D], kv [B, N, D], attn_sink [H] fp32, topk_idxs [B, S, K] (-1 masked)
    -> out [B, S, H, d_v]. Differentiable. ``topk_length`` [B, S] and ``d_v`` as in
    ``sparse_mla``.
    """
    return sparse_mla(q, kv, topk_idxs, attn_sink, softmax_scale, topk_length=topk_length, d_v=d_v)
