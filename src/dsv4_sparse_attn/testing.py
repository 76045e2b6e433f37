"""Helpers for testing and benchmarking code that uses the ops: DeepSeek-style index
generators, the float64 oracle and one closeness measure. The package's own tests,
benchmarks and examples use these; so can yours.

    from dsv4_sparse_attn.testing import deepseek_indices, oracle_fwd, relerr
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import reference

__all__ = ["relerr", "deepseek_indices", "causal_indices", "oracle_fwd", "oracle_bwd"]


def relerr(x: Tensor, ref: Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; inf if x has a NaN where ref has none (an
    unwritten, poisoned element) or its infinities differ from ref's.

    Infinite entries (lse = -inf on empty rows without a sink) must match exactly and are
    left out of the norm; NaNs must match NaNs. With ref == 0, the absolute error.
    """
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    if x.shape != ref.shape:
        raise ValueError(f"relerr: shapes differ: {list(x.shape)} vs {list(ref.shape)}")
    nan = torch.isnan(ref)
    if not torch.equal(torch.isnan(x), nan):
        return float("inf")
    inf = torch.isinf(ref)
    if not torch.equal(torch.isinf(x), inf) or not torch.equal(x[inf], ref[inf]):
        return float("inf")
    keep = ~(inf | nan)
    x, ref = x[keep], ref[keep]
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num if den == 0.0 else num / den


def deepseek_indices(T: int, K: int, *, window: int = 128, n_pool: Optional[int] = None, pool: str = "random",
                     device="cpu", dtype=torch.int32, generator: Optional[torch.Generator] = None) -> Tensor:
    """DeepSeek-V4 prefill ids for T tokens into kv rows [0, T + n_pool): the causal window
    t-window+1..t (-1 where negative), then K - window ids into a compressed pool of
    ``n_pool`` rows (default T // 4) stored after the T raw rows:

    - ``pool="random"``: uniform ids, duplicates possible (the benchmark table's ids);
    - ``pool="distinct"``: distinct ids per token (cuDNN's side-by-side inputs; needs
      n_pool >= K - window);
    - ``pool="causal"``: token t selects distinct pool rows p < t // 4 and -1 where the
      pool is still too short (what a causal indexer produces).
    """
    n_pool = T // 4 if n_pool is None else n_pool
    t = torch.arange(T, device=device)[:, None]
    w = min(window, K)
    win = t - torch.arange(w - 1, -1, -1, device=device)[None, :]
    win = torch.where(win >= 0, win, torch.full_like(win, -1))
    rest = K - w
    if rest <= 0:
        return win.to(dtype)
    if pool == "random":
        ids = torch.randint(0, max(n_pool, 1), (T, rest), device=device, generator=generator)
    elif pool in ("distinct", "causal"):
        if n_pool < rest and pool == "distinct":
            raise ValueError(f"deepseek_indices: {rest} distinct pool ids need n_pool >= {rest}, "
                             f"got {n_pool}")
        width = max(n_pool, rest)
        ids = torch.empty((T, rest), dtype=torch.long, device=device)
        step = max(1, 2**25 // width)  # tokens per chunk: a [step, width] sort key at a time
        for t0 in range(0, T, step):
            tt = t[t0:t0 + step]
            u = torch.rand(tt.shape[0], width, device=device, generator=generator)
            if pool == "causal":  # rows p >= t // 4 are not compressed yet: sort them last
                u = u + (torch.arange(width, device=device)[None, :] >= tt // 4).float() * 2
            chosen = torch.argsort(u, dim=1)[:, :rest]
            if pool == "causal":
                chosen = torch.where(chosen < tt // 4, chosen, torch.full_like(chosen, -1 - T))
            ids[t0:t0 + step] = chosen
    else:
        raise ValueError(f"deepseek_indices: pool must be 'random', 'distinct' or 'causal', got {pool!r}")
    return torch.cat([win, ids + T], dim=1).to(dtype)


def causal_indices(shape: Sequence[int], K: int, window: int, *, device="cpu", dtype=torch.int32,
                   generator: Optional[torch.Generator] = None) -> Tensor:
    """Ids into a sequence's own S rows (for a block whose kv comes from its own x): the
    causal window t-window+1..t (-1 where negative), then K - window random earlier
    positions 0..t (a stand-in for the indexer's top-k; duplicates possible).

    ``shape`` is (S,) for flat [S, K] ids or (B, S) for batched [B, S, K] ids.
    """
    *lead, S = shape
    t = torch.arange(S, device=device)[:, None]
    w = min(window, K)
    win = t - torch.arange(w - 1, -1, -1, device=device)[None, :]
    win = torch.where(win >= 0, win, torch.full_like(win, -1)).expand(*lead, S, w)
    u = torch.rand(*lead, S, K - w, device=device, generator=generator)
    rnd = (u * (t + 1)).long().clamp(max=S - 1)
    return torch.cat([win, rnd], dim=-1).to(dtype)


def _cpu(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.cpu()


def oracle_fwd(q: Tensor, kv: Tensor, indices: Tensor, attn_sink: Optional[Tensor],
               scale: Optional[float] = None, topk_length: Optional[Tensor] = None,
               d_v: Optional[int] = None):
    """The exact reference in float64 on the CPU (inputs upcast): (out, lse)."""
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    kv2 = kv if kv.dim() == 2 else kv[:, 0]
    s = None if attn_sink is None else attn_sink.detach().double().cpu()
    return reference.sparse_mla_fwd(q.detach().double().cpu(), kv2.detach().double().cpu(), indices.cpu(),
                                    s, scale, _cpu(topk_length), d_v)


def oracle_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, kv: Tensor, indices: Tensor,
               attn_sink: Optional[Tensor], scale: Optional[float] = None,
               topk_length: Optional[Tensor] = None, d_v: Optional[int] = None):
    """The float64 backward, with out and lse recomputed in float64 (not taken from the
    kernel under test): (grad_q, grad_kv, grad_sink)."""
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    kv2 = kv if kv.dim() == 2 else kv[:, 0]
    q64, kv64 = q.detach().double().cpu(), kv2.detach().double().cpu()
    s = None if attn_sink is None else attn_sink.detach().double().cpu()
    out, lse = reference.sparse_mla_fwd(q64, kv64, indices.cpu(), s, scale, _cpu(topk_length), d_v)
    dl = None if grad_lse is None else grad_lse.detach().double().cpu()
    return reference.sparse_mla_bwd(grad_out.detach().double().cpu(), dl, q64, kv64, out, lse,
                                    indices.cpu(), s, scale, _cpu(topk_length), d_v)
