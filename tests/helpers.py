"""Shared test utilities: input makers, the float64 oracle and one closeness measure."""
from __future__ import annotations

from typing import Optional

import torch

from dsv4_sparse_attn import reference

POISON = float("nan")


def relerr(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; inf if x has a NaN (an unwritten poisoned element).

    Infinite entries (lse = -inf on empty rows without sink) must match exactly and
    are left out of the norm.
    """
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    assert x.shape == ref.shape, (x.shape, ref.shape)
    if torch.isnan(x).any():
        return float("inf")
    inf = torch.isinf(ref)
    if not torch.equal(torch.isinf(x), inf) or not torch.equal(x[inf], ref[inf]):
        return float("inf")
    x, ref = x[~inf], ref[~inf]
    den = ref.norm().item()
    num = (x - ref).norm().item()
    if den == 0.0:
        return num
    return num / den


def deepseek_indices(T: int, K: int, window: int = 128, n_pool: int = 0, device="cpu",
                     dtype=torch.int32, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """DeepSeek-structured ids: the causal window t-window+1..t (-1 where negative), then
    K - window random ids into a pool of ``n_pool`` rows stored after the T raw rows."""
    t = torch.arange(T, device=device)[:, None]
    w = min(window, K)
    win = t - torch.arange(w - 1, -1, -1, device=device)[None, :]
    win = torch.where(win >= 0, win, torch.full_like(win, -1))
    if K > w:
        pool = torch.randint(0, max(n_pool, 1), (T, K - w), device=device, generator=generator) + T
        idx = torch.cat([win, pool], dim=1)
    else:
        idx = win
    return idx.to(dtype)


def make_inputs(T, H, D, N, K, dtype=torch.float32, device="cpu", sink=True, idx_dtype=torch.int32,
                lo=None, hi=None, requires_grad=False, sink_scale=1.0):
    """Fresh random inputs. Ids are drawn from [lo, hi) (default [-2, N + 2): some masked)."""
    lo = -2 if lo is None else lo
    hi = N + 2 if hi is None else hi
    q = torch.randn(T, H, D, dtype=dtype, device=device)
    kv = torch.randn(N, D, dtype=dtype, device=device)
    idx = torch.randint(lo, hi, (T, K), device=device).to(idx_dtype)
    s = (torch.randn(H, device=device) * sink_scale).float() if sink else None
    if requires_grad:
        q.requires_grad_(True)
        kv.requires_grad_(True)
        if s is not None:
            s.requires_grad_(True)
    return q, kv, idx, s


def oracle_fwd(q, kv, idx, sink, scale=None):
    """The reference run in float64 on the CPU (inputs upcast): the oracle."""
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    kv2 = kv if kv.dim() == 2 else kv[:, 0]
    s = None if sink is None else sink.detach().double().cpu()
    return reference.sparse_mla_fwd(q.detach().double().cpu(), kv2.detach().double().cpu(),
                                    idx.cpu(), s, scale)


def oracle_bwd(do, dlse, q, kv, idx, sink, scale=None):
    """float64 backward; out and lse recomputed in float64 (not taken from the kernel)."""
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    kv2 = kv if kv.dim() == 2 else kv[:, 0]
    q64, kv64 = q.detach().double().cpu(), kv2.detach().double().cpu()
    s = None if sink is None else sink.detach().double().cpu()
    out, lse = reference.sparse_mla_fwd(q64, kv64, idx.cpu(), s, scale)
    dl = None if dlse is None else dlse.detach().double().cpu()
    return reference.sparse_mla_bwd(do.detach().double().cpu(), dl, q64, kv64, out, lse, idx.cpu(), s, scale)


def causal_indices(shape, K: int, window: int, device="cpu", dtype=torch.int32,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """DeepSeek-style ids into a sequence's own S rows, for blocks whose kv is computed
    from x: the causal window t-window+1..t (-1 where negative), then K - window random
    earlier positions 0..t (standing in for the indexer's top-k; duplicates possible).

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
