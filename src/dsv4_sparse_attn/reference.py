"""The exact PyTorch implementation: the CPU kernel of the ops and the oracle of every test.

fp32 accumulation throughout (fp64 for fp64 inputs) (inputs are upcast per chunk), backward as explicit
formulas (autograd is off inside custom ops), and chunked over tokens so the
gathered rows and score temporaries stay under ``CHUNK_BYTES`` whatever T is.

Math (docs/design.md#the-operation), per token t and head h over the valid slots j:
    s_j = scale * <q, kv[idx_j]>,  lse = log(sum_j exp(s_j) + exp(sink)),
    p_j = exp(s_j - lse),          o   = sum_j p_j kv[idx_j, :d_v]
(d_v = D unless given: the DeepSeek-V3.2 layout scores 576 columns and takes the first 512
as values.) Ids < 0 or >= N, and slots j >= topk_length[t] when given, are masked. A row
with no valid slot gives o = 0 and lse = sink (or -inf without a sink). Non-finite values
follow IEEE arithmetic of these formulas over all K slots, a masked slot's row being zero
and its score -inf: a NaN sink makes its head's o and lse NaN, a +inf sink gives o = 0 and
lse = +inf (docs/design.md#non-finite-values).
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

from .validation import lse_dtype

CHUNK_BYTES = 256 * 2**20


def token_chunk(H: int, D: int, K: int, budget: Optional[int] = None) -> int:
    """Tokens per chunk so that the per-chunk temporaries stay under ``budget`` bytes.

    Per token: gathered rows (input dtype + fp32 copy + up to three fp32 [K, D]
    products in the backward) and about six fp32 [H, K] score-sized tensors.
    """
    budget = CHUNK_BYTES if budget is None else budget
    per_token = K * D * (2 + 4 * 4) + H * K * 4 * 6 + H * D * 4 * 4 + 64
    return max(1, budget // per_token)


def _chunks(T: int, step: int) -> Iterator[Tuple[int, int]]:
    for t0 in range(0, T, step):
        yield t0, min(T, t0 + step)


def _present(idx: Tensor, length: Optional[Tensor]) -> Optional[Tensor]:
    """[Tc, K] slots j < length[t] (None without lengths). Lengths above K act as K, below 0
    as 0. A slot past the length is absent, as if K were the length: unlike a masked id it
    takes no part at all (not even 0 * NaN when a NaN sink makes Delta NaN)."""
    if length is None:
        return None
    return torch.arange(idx.shape[1], device=idx.device)[None, :] < length.long()[:, None]


def _gather(kv: Tensor, idx: Tensor, present: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Rows kv[idx] as fp32 [Tc, K, D], the validity mask and the clamped ids.

    A masked slot's row is zero, not a copy of row 0: a NaN or inf in a row that no token
    selects must change nothing (0 * NaN would reach out and grad_q)."""
    N, D = kv.shape
    idx = idx.long()
    valid = (idx >= 0) & (idx < N)
    if present is not None:
        valid &= present
    safe = torch.where(valid, idx, torch.zeros((), dtype=idx.dtype, device=idx.device))
    if N == 0:
        rows = torch.zeros((*idx.shape, D), dtype=lse_dtype(kv), device=kv.device)
    else:
        rows = kv.index_select(0, safe.reshape(-1)).view(*idx.shape, D).to(lse_dtype(kv))
        rows = rows.masked_fill(~valid[..., None], 0.0)
    return rows, valid, safe


def _scores(q: Tensor, rows: Tensor, valid: Tensor, scale: float) -> Tensor:
    s = torch.einsum("thd,tkd->thk", q.to(rows.dtype), rows) * scale
    return s.masked_fill(~valid[:, None, :], float("-inf"))


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    """p = exp(s - lse); 0 on masked slots and on rows whose lse is -inf (empty, no sink).
    An lse of +inf (a +inf sink) gives p = 0, a NaN lse (a NaN sink) p = NaN."""
    lse_safe = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    return torch.exp(s - lse_safe[..., None])


def _absent_to_zero(x: Tensor, present: Optional[Tensor]) -> Tensor:
    """x [Tc, H, K] with the absent slots' entries 0."""
    return x if present is None else torch.where(present[:, None, :], x, torch.zeros((), dtype=x.dtype))


def sparse_mla_fwd(
    q: Tensor, kv: Tensor, indices: Tensor, attn_sink: Optional[Tensor], scale: float,
    topk_length: Optional[Tensor] = None, d_v: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Forward. ``kv`` is [N, D]; returns out [T, H, d_v] (q's dtype) and lse [T, H] fp32.
    Scores use all D columns, values the first ``d_v`` (default D) of the same rows."""
    T, H, D = q.shape
    K = indices.shape[1]
    d_v = D if d_v is None else d_v
    out = torch.empty((T, H, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((T, H), dtype=lse_dtype(q), device=q.device)
    for t0, t1 in _chunks(T, token_chunk(H, D, K)):
        present = _present(indices[t0:t1], None if topk_length is None else topk_length[t0:t1])
        rows, valid, _ = _gather(kv, indices[t0:t1], present)
        s = _scores(q[t0:t1], rows, valid, scale)
        if attn_sink is not None:
            # The sink joins the denominator only: one extra logit per head.
            sink = attn_sink.to(s.dtype)[None, :, None].expand(t1 - t0, H, 1)
            lse_c = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
        elif K > 0:
            lse_c = torch.logsumexp(s, dim=-1)
        else:
            lse_c = torch.full((t1 - t0, H), float("-inf"), dtype=s.dtype, device=q.device)
        p = _absent_to_zero(_probs(s, lse_c), present)
        o = torch.einsum("thk,tkd->thd", p, rows[..., :d_v])
        # A NaN lse (a NaN sink or score) makes the head's out NaN even with no slot (K = 0).
        o = torch.where(torch.isnan(lse_c)[..., None], torch.full((), float("nan"), dtype=o.dtype), o)
        out[t0:t1] = o.to(q.dtype)
        lse[t0:t1] = lse_c
    return out, lse


def sparse_mla_bwd(
    grad_out: Tensor,
    grad_lse: Optional[Tensor],
    q: Tensor,
    kv: Tensor,
    out: Tensor,
    lse: Tensor,
    indices: Tensor,
    attn_sink: Optional[Tensor],
    scale: float,
    topk_length: Optional[Tensor] = None,
    d_v: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward. ``kv`` is [N, D], grad_out and out [T, H, d_v]; returns grad_q [T, H, D],
    grad_kv [N, D], grad_sink ([H] or empty)."""
    T, H, D = q.shape
    N = kv.shape[0]
    K = indices.shape[1]
    d_v = D if d_v is None else d_v
    grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
    acc = lse_dtype(q)
    grad_kv = torch.zeros((N, D), dtype=acc, device=q.device)
    grad_sink = torch.zeros((H,), dtype=acc, device=q.device)
    for t0, t1 in _chunks(T, token_chunk(H, D, K)):
        present = _present(indices[t0:t1], None if topk_length is None else topk_length[t0:t1])
        rows, valid, safe = _gather(kv, indices[t0:t1], present)
        s = _scores(q[t0:t1], rows, valid, scale)
        lse_c = lse[t0:t1]
        p = _probs(s, lse_c)
        do = grad_out[t0:t1].to(acc)
        delta = (out[t0:t1].to(acc) * do).sum(-1)
        if grad_lse is not None:
            delta = delta - grad_lse[t0:t1]
        dp = torch.einsum("thd,tkd->thk", do, rows[..., :d_v])
        p = _absent_to_zero(p, present)
        ds = _absent_to_zero(p * (dp - delta[..., None]), present)
        grad_q[t0:t1] = (scale * torch.einsum("thk,tkd->thd", ds, rows)).to(q.dtype)
        drows = scale * torch.einsum("thk,thd->tkd", ds, q[t0:t1].to(acc))
        drows[..., :d_v] += torch.einsum("thk,thd->tkd", p, do)
        drows = torch.where(valid[..., None], drows, torch.zeros((), dtype=acc, device=q.device))
        if N > 0:
            grad_kv.index_add_(0, safe.reshape(-1), drows.reshape(safe.numel(), D))
        if attn_sink is not None:
            grad_sink -= (torch.exp(attn_sink.to(acc)[None, :] - lse_c) * delta).sum(0)
    if attn_sink is None:
        grad_sink = grad_sink.new_empty((0,))
    if attn_sink is not None:
        grad_sink = grad_sink.to(attn_sink.dtype)
    return grad_q, grad_kv.to(kv.dtype), grad_sink
