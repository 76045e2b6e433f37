"""Shared test utilities: the input maker of the tests, and the package's own index
generators, float64 oracle and closeness measure (``dsv4_sparse_attn.testing``,
re-exported so tests keep importing them from here)."""
from __future__ import annotations

import torch

from dsv4_sparse_attn.testing import causal_indices, deepseek_indices, oracle_bwd, oracle_fwd, relerr

__all__ = ["POISON", "make_inputs", "relerr", "deepseek_indices", "causal_indices", "oracle_fwd",
           "oracle_bwd"]

POISON = float("nan")


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
