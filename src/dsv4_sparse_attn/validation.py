"""Argument checks shared by every path (fake kernels, CPU reference, CUDA kernels).

Each check raises TypeError (wrong dtype / not a tensor) or ValueError (wrong
shape, device or value) naming the argument, what was expected and what was
received, so a user sees the same message whichever backend runs.
"""
from __future__ import annotations

import math
import struct
from typing import NamedTuple, Optional

import torch
from torch import Tensor

# float64 is accepted for checking (gradcheck, oracles); it always runs the reference.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


class Problem(NamedTuple):
    """Sizes of one call, after validation."""

    T: int  # tokens
    H: int  # heads
    D: int  # head dim
    N: int  # kv rows
    K: int  # selected slots per token
    scale: float
    d_v: int  # value columns: kv[:, :d_v] (D unless given)
    has_len: bool = False  # a per-token topk_length was given


def _shape(x: Tensor) -> list:
    return list(x.shape)


def _expect_tensor(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"sparse_mla: {name} must be a torch.Tensor, got {type(x).__name__}")


def _expect_float(name: str, x: Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"sparse_mla: {name} must have dtype bfloat16, float16 or float32 (float64 for checking), "
            f"got {x.dtype}"
        )


def _same_device(name: str, x: Tensor, ref_name: str, ref: Tensor) -> None:
    if x.device != ref.device:
        raise ValueError(
            f"sparse_mla: {name} must be on the same device as {ref_name} ({ref.device}), got {x.device}"
        )


def lse_dtype(q: Tensor) -> torch.dtype:
    """Accumulation / lse dtype: float32, or float64 for float64 inputs."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def kv_rows(kv: Tensor) -> Tensor:
    """View kv [N, D] or [N, 1, D] as [N, D] (no copy)."""
    return kv if kv.dim() == 2 else kv.select(1, 0)


def resolve_scale(scale: Optional[float], D: int) -> float:
    if scale is None:
        if D <= 0:
            raise ValueError(f"sparse_mla: head dim D must be positive, got {D}")
        return D ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"sparse_mla: scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"sparse_mla: scale must be a finite positive number, got {scale}")
    # The kernels compute in fp32: a scale that overflows or flushes to zero there would
    # silently give inf/NaN or uniform attention.
    s32 = struct.unpack("f", struct.pack("f", scale))[0] if scale < 3.4e38 else math.inf
    if not math.isfinite(s32) or s32 <= 0.0:
        raise ValueError(f"sparse_mla: scale must be finite and positive in float32, got {scale}")
    return scale


def resolve_d_v(d_v, D: int) -> int:
    if d_v is None:
        return D
    if isinstance(d_v, bool) or not isinstance(d_v, (int, torch.SymInt)):
        raise TypeError(f"sparse_mla: d_v must be an int or None, got {type(d_v).__name__}")
    if not 1 <= d_v <= D:
        raise ValueError(f"sparse_mla: d_v must be in [1, D] = [1, {D}] (values are kv[:, :d_v]), got {d_v}")
    return d_v


def _check_topk_length(topk_length: Tensor, T: int, q: Tensor) -> None:
    _expect_tensor("topk_length", topk_length)
    if topk_length.dim() != 1 or topk_length.shape[0] != T:
        raise ValueError(
            f"sparse_mla: topk_length must have shape [T] with T={T} (q's first dim), "
            f"got shape {_shape(topk_length)}"
        )
    if topk_length.dtype != torch.int32:
        raise TypeError(f"sparse_mla: topk_length must have dtype int32, got {topk_length.dtype}")
    _same_device("topk_length", topk_length, "q", q)


def check_forward(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    attn_sink: Optional[Tensor],
    scale: Optional[float],
    topk_length: Optional[Tensor] = None,
    d_v: Optional[int] = None,
) -> Problem:
    """Validate the forward arguments; return the problem sizes."""
    for name, x in (("q", q), ("kv", kv), ("indices", indices)):
        _expect_tensor(name, x)
    if q.dim() != 3:
        raise ValueError(f"sparse_mla: q must be a 3-D tensor [T, H, D], got shape {_shape(q)}")
    T, H, D = q.shape
    if kv.dim() == 3 and kv.shape[1] != 1:
        raise ValueError(
            f"sparse_mla: kv must have shape [N, D] or [N, 1, D], got shape {_shape(kv)}"
        )
    if kv.dim() not in (2, 3):
        raise ValueError(
            f"sparse_mla: kv must have shape [N, D] or [N, 1, D], got shape {_shape(kv)}"
        )
    if kv.shape[-1] != D:
        raise ValueError(
            f"sparse_mla: kv's last dim must equal q's head dim D={D}, got kv shape {_shape(kv)}"
        )
    if indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(
            f"sparse_mla: indices must have shape [T, K] with T={T} (q's first dim), "
            f"got shape {_shape(indices)}"
        )
    _expect_float("q", q)
    if kv.dtype != q.dtype:
        raise TypeError(f"sparse_mla: kv must have the same dtype as q ({q.dtype}), got {kv.dtype}")
    if indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"sparse_mla: indices must have dtype int32 or int64, got {indices.dtype}")
    _same_device("kv", kv, "q", q)
    _same_device("indices", indices, "q", q)
    if attn_sink is not None:
        _expect_tensor("attn_sink", attn_sink)
        if attn_sink.dim() != 1 or attn_sink.shape[0] != H:
            raise ValueError(
                f"sparse_mla: attn_sink must have shape [H] with H={H}, got shape {_shape(attn_sink)}"
            )
        if attn_sink.dtype != torch.float32 and not (q.dtype == attn_sink.dtype == torch.float64):
            raise TypeError(f"sparse_mla: attn_sink must have dtype float32, got {attn_sink.dtype}")
        _same_device("attn_sink", attn_sink, "q", q)
    if topk_length is not None:
        _check_topk_length(topk_length, T, q)
    return Problem(T=T, H=H, D=D, N=kv.shape[0], K=indices.shape[1], scale=resolve_scale(scale, D),
                   d_v=resolve_d_v(d_v, D), has_len=topk_length is not None)


def check_backward(
    grad_out: Tensor,
    grad_lse: Optional[Tensor],
    q: Tensor,
    kv: Tensor,
    out: Tensor,
    lse: Tensor,
    indices: Tensor,
    attn_sink: Optional[Tensor],
    scale: Optional[float],
    topk_length: Optional[Tensor] = None,
    d_v: Optional[int] = None,
) -> Problem:
    """Validate the backward arguments; return the problem sizes."""
    p = check_forward(q, kv, indices, attn_sink, scale, topk_length, d_v)
    for name, x in (("grad_out", grad_out), ("out", out), ("lse", lse)):
        _expect_tensor(name, x)
    for name, x in (("grad_out", grad_out), ("out", out)):
        if x.shape != (p.T, p.H, p.d_v):
            raise ValueError(
                f"sparse_mla: {name} must have shape [T, H, d_v] = [{p.T}, {p.H}, {p.d_v}], "
                f"got shape {_shape(x)}"
            )
        if x.dtype != q.dtype:
            raise TypeError(f"sparse_mla: {name} must have q's dtype ({q.dtype}), got {x.dtype}")
        _same_device(name, x, "q", q)
    lse_like = [("lse", lse)] + ([("grad_lse", grad_lse)] if grad_lse is not None else [])
    for name, x in lse_like:
        _expect_tensor(name, x)
        if x.shape != (p.T, p.H):
            raise ValueError(
                f"sparse_mla: {name} must have shape [T, H] = [{p.T}, {p.H}], got shape {_shape(x)}"
            )
        if x.dtype != lse_dtype(q):
            raise TypeError(f"sparse_mla: {name} must have dtype {lse_dtype(q)}, got {x.dtype}")
        _same_device(name, x, "q", q)
    return p
