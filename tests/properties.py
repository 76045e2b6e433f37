"""Property-based checks (hypothesis) of sparse MLA against an independent float64 oracle.

``problems()`` draws a whole call: shapes (T, H, K, N, D down to 0 and 1), id patterns
(duplicates, masked, past N, the extremes of int32/int64, tokens with no valid slot),
dtypes, sinks (finite, extreme, NaN, +inf, -inf) and non-finite values in q or kv (in a
row no token selects, in a selected row, in q). ``oracle()`` is written from
docs/design.md#the-operation and #non-finite-values alone: a loop over tokens in float64,
the formulas over all K slots with a masked slot's row zero and its score -inf.
``assert_matches()`` demands the oracle's NaNs and infinities exactly and closeness
elsewhere.

Three suites use them: tests/test_properties.py (the CPU ops, flat and batched),
tests/interpreter/test_properties_interpret.py (the Triton kernels under the
interpreter) and tests/test_properties_gpu.py (the CUDA kernels, more examples).
Examples per test: the hypothesis profile of tests/conftest.py.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch import Tensor

F64 = torch.float64
NAN, INF = float("nan"), float("inf")
INT_EXTREMES = {torch.int32: (-2**31, 2**31 - 1), torch.int64: (-2**63, 2**63 - 1)}
# Relative bounds on ||x - ref|| against ||ref|| + the absolute floor (cancellation in
# dS = P (dP - Delta) leaves noise of the output's rounding where the exact value is 0).
TOL = {F64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 6e-3}
FLOOR = {F64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


LSE_TOL = 1e-4  # lse is fp32 from fp32 logits, whatever the input dtype


def property_settings(examples: int):
    """A fixed seed (derandomize) and ``examples`` examples, times DSV4_PROPERTY_SCALE (the
    H200 run raises it); no example database and no deadline (the first example of a
    kernel compiles it)."""
    n = max(1, round(examples * float(os.environ.get("DSV4_PROPERTY_SCALE", "1"))))
    return settings(max_examples=n, derandomize=True, database=None, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Problem:
    q: Tensor  # [T, H, D]
    kv: Tensor  # [N, D]
    idx: Tensor  # [T, K]
    sink: Optional[Tensor]  # [H] fp32 (fp64 with fp64 inputs)
    scale: Optional[float]
    grad_out: Tensor  # [T, H, D]
    grad_lse: Optional[Tensor]  # [T, H]
    note: str  # what was drawn, for the failure message
    # False when q or a selected kv row holds a NaN or inf: an (token, head) entry that
    # uses it must be non-finite, but whether NaN or inf depends on the order of operations
    # (an online softmax meets inf - inf where the oracle's two passes do not).
    exact: bool = True
    topk_length: Optional[Tensor] = None  # int32 [T]
    d_v: Optional[int] = None

    def __repr__(self):
        T, H, D = self.q.shape
        return (f"Problem(T={T}, H={H}, D={D}, N={self.kv.shape[0]}, K={self.idx.shape[1]}, "
                f"{self.q.dtype}, {self.idx.dtype}, scale={self.scale}, d_v={self.d_v}, "
                f"topk_length={None if self.topk_length is None else self.topk_length.tolist()}, "
                f"{self.note})")

    def to(self, device) -> "Problem":
        mv = (lambda x: None if x is None else x.to(device))
        return Problem(mv(self.q), mv(self.kv), mv(self.idx), mv(self.sink), self.scale, mv(self.grad_out),
                       mv(self.grad_lse), self.note, self.exact, mv(self.topk_length), self.d_v)


@st.composite
def problems(draw, *, D=(0, 1, 2, 3, 8), H=(0, 4), T=(0, 5), K=(0, 9), N=(0, 8),
             dtypes=(F64, torch.float32, torch.bfloat16, torch.float16), nonfinite_inputs=True,
             lengths=True, narrow_values=True):
    """One random call. ``D``: the head dims to pick from; ``T``, ``K``, ``N``: inclusive
    ranges; ``H``: a range (two values) or the head counts to pick from. ``lengths``:
    may draw a topk_length (values in [-2, K + 2]); ``narrow_values``: True (may draw any
    d_v < D), False (d_v = D) or {D: [d_v choices, None for D]} (what kernels take).
    Values come from a drawn seed (shrinking keeps the shapes small)."""
    d = draw(st.sampled_from(D))
    h = draw(st.integers(*H) if len(H) == 2 else st.sampled_from(H))  # a range or the values
    t, k, n = (draw(st.integers(*r)) for r in (T, K, N))
    dtype = draw(st.sampled_from(dtypes))
    idx_dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    q = torch.randn(t, h, d, generator=g).to(dtype)
    kv = torch.randn(n, d, generator=g).to(dtype)

    # ids: valid ones, then masked ones of every kind on a drawn fraction of the slots
    idx = torch.randint(0, max(n, 1), (t, k), generator=g, dtype=torch.int64) if n else torch.full((t, k), -1)
    ids = draw(st.sampled_from(("random", "dup", "masked", "extreme", "empty_rows")))
    lo, hi = INT_EXTREMES[idx_dtype]
    if ids == "dup" and k > 1:
        idx[:, 1::2] = idx[:, :1]
    elif ids in ("masked", "extreme"):
        bad = torch.tensor([-1, n, n + 1, -2] + ([lo, hi, lo + 1, hi - 1] if ids == "extreme" else []))
        pick = bad[torch.randint(0, len(bad), (t, k), generator=g)]
        idx = torch.where(torch.rand(t, k, generator=g) < 0.5, pick, idx)
    elif ids == "empty_rows" and t:
        idx[::2] = -1
    note = [ids]

    sink = None
    if draw(st.booleans()):
        sink = torch.randn(h, generator=g) * draw(st.sampled_from((1.0, 30.0)))
        special = draw(st.sampled_from(("none", "nan", "+inf", "-inf", "mixed")))
        if h and special != "none":
            vals = {"nan": [NAN], "+inf": [INF], "-inf": [-INF],
                    "mixed": [NAN, INF, -INF, 1e4, -1e4]}[special]
            head = torch.randint(0, h, (max(1, h // 2),), generator=g)
            sink[head] = torch.tensor(vals)[torch.randint(0, len(vals), head.shape, generator=g)]
        sink = sink.to(F64 if dtype == F64 else torch.float32)
        note.append(f"sink {special}")

    if nonfinite_inputs:
        bad_in = draw(st.sampled_from(("none", "none", "unselected_row", "selected_row", "q")))
        bad_val = draw(st.sampled_from((NAN, INF, -INF)))
        valid = (idx >= 0) & (idx < n)
        if bad_in == "unselected_row" and n and d:
            r = int(torch.randint(0, n, (1,), generator=g))
            idx = torch.where(idx == r, torch.full_like(idx, -1), idx)  # nobody selects row r
            kv[r, int(torch.randint(0, d, (1,), generator=g))] = bad_val
        elif bad_in == "selected_row" and valid.any() and d:
            r = int(idx[valid][0])
            kv[r, int(torch.randint(0, d, (1,), generator=g))] = bad_val
        elif bad_in == "q" and q.numel():
            q.view(-1)[int(torch.randint(0, q.numel(), (1,), generator=g))] = bad_val
        else:
            bad_in = "none"
        if bad_in in ("selected_row", "q") and sink is not None:
            # +inf sink and +inf score: which of them gets the weight is not defined
            # (docs/design.md#non-finite-values); keep the sink finite there.
            sink = torch.where(sink == INF, torch.zeros_like(sink), sink)
        note.append(f"{bad_in} {bad_val}" if bad_in != "none" else "finite inputs")

    scale = None if d and draw(st.booleans()) else draw(st.sampled_from((0.125, 0.5, 1.0)))
    topk_length = None
    if lengths and draw(st.booleans()):
        topk_length = torch.randint(-2, k + 3, (t,), generator=g, dtype=torch.int32)
        note.append("topk_length")
    if isinstance(narrow_values, dict):
        d_v = draw(st.sampled_from(narrow_values[d]))
    else:
        d_v = draw(st.integers(1, d)) if narrow_values and d and draw(st.booleans()) else None
    grad_out = torch.randn(t, h, d if d_v is None else d_v, generator=g).to(dtype)
    grad_lse = torch.randn(t, h, generator=g).to(F64 if dtype == F64 else torch.float32) \
        if draw(st.booleans()) else None
    exact = not nonfinite_inputs or bad_in not in ("selected_row", "q")
    return Problem(q, kv, idx.to(idx_dtype), sink, scale, grad_out, grad_lse, ", ".join(note), exact,
                   topk_length, d_v)


def _logsumexp(x: Tensor) -> Tensor:
    """log(sum(exp(x))) over the last dim in IEEE terms: NaN if any NaN, +inf if any +inf,
    -inf if every term is -inf (or there is none)."""
    if x.shape[-1] == 0:
        return torch.full(x.shape[:-1], -INF, dtype=x.dtype)
    m = x.max(-1).values
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    out = shift + torch.log(torch.exp(x - shift[..., None]).sum(-1))
    out = torch.where(m == INF, torch.full_like(m, INF), out)
    return torch.where(torch.isnan(x).any(-1), torch.full_like(m, NAN), out)


def oracle(p: Problem):
    """float64 (out, lse, grad_q, grad_kv, grad_sink) of ``p``, token by token."""
    q, kv, do = (x.detach().cpu().to(F64) for x in (p.q, p.kv, p.grad_out))
    idx = p.idx.cpu().to(torch.int64)
    sink = None if p.sink is None else p.sink.cpu().to(F64)
    dlse = None if p.grad_lse is None else p.grad_lse.cpu().to(F64)
    T, H, D = q.shape
    N, K = kv.shape[0], idx.shape[1]
    d_v = D if p.d_v is None else p.d_v
    scale = D ** -0.5 if p.scale is None else p.scale
    out, dq = torch.zeros(T, H, d_v, dtype=F64), torch.zeros(T, H, D, dtype=F64)
    lse = torch.zeros(T, H, dtype=F64)
    dkv, dsink = torch.zeros(N, D, dtype=F64), torch.zeros(H, dtype=F64)
    for t in range(T):
        ids = idx[t]
        if p.topk_length is not None:  # slots past the length are absent (as if K were shorter)
            ids = ids[:max(0, min(K, int(p.topk_length[t])))]
        valid = (ids >= 0) & (ids < N)
        rows = torch.zeros(len(ids), D, dtype=F64)
        rows[valid] = kv[ids[valid]]
        s = torch.where(valid[None, :], scale * (q[t] @ rows.T), torch.full((), -INF, dtype=F64))  # [H, K]
        logits = s if sink is None else torch.cat([s, sink[:, None]], 1)
        lse[t] = _logsumexp(logits)
        pr = torch.exp(s - torch.where(lse[t] == -INF, torch.zeros_like(lse[t]), lse[t])[:, None])
        vals = rows[:, :d_v]
        out[t] = pr @ vals
        out[t][torch.isnan(lse[t])] = NAN  # even with K = 0
        delta = (out[t] * do[t]).sum(-1) - (0 if dlse is None else dlse[t])
        ds = pr * (do[t] @ vals.T - delta[:, None])
        dq[t] = scale * (ds @ rows)
        drows = scale * (ds.T @ q[t])
        drows[:, :d_v] += pr.T @ do[t]
        dkv.index_add_(0, ids[valid], drows[valid])
        if sink is not None:
            dsink -= torch.exp(sink - lse[t]) * delta
    return out, lse, dq, dkv, (None if sink is None else dsink)


def assert_close(name: str, x: Optional[Tensor], ref: Optional[Tensor], dtype, p: Problem, tol_scale=1.0):
    """``x`` has ``ref``'s NaNs and infinities exactly (same sign) and is close elsewhere."""
    if ref is None:
        assert x is None or x.numel() == 0, f"{name}: expected none, got {x.shape}; {p}"
        return
    x, ref = x.detach().cpu().to(F64), ref.to(F64)
    tol, floor = (LSE_TOL, LSE_TOL) if dtype == "lse" else (TOL[dtype], FLOOR[dtype])
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} vs {tuple(ref.shape)}; {p}"
    if not p.exact:  # the same entries non-finite, which of NaN / inf aside
        fin_x, fin_r = torch.isfinite(x), torch.isfinite(ref)
        assert torch.equal(fin_x, fin_r), (
            f"{name}: non-finite where the oracle is finite at {(fin_r & ~fin_x).nonzero()[:4].tolist()}, "
            f"finite where it is not at {(fin_x & ~fin_r).nonzero()[:4].tolist()}; {p}")
        x, ref = torch.where(fin_r, x, 0.0), torch.where(fin_r, ref, 0.0)
    nan_x, nan_r = torch.isnan(x), torch.isnan(ref)
    assert torch.equal(nan_x, nan_r), (
        f"{name}: NaN where the oracle has none at {(nan_x & ~nan_r).nonzero()[:4].tolist()}, "
        f"or a number where it has NaN at {(nan_r & ~nan_x).nonzero()[:4].tolist()}; {p}")
    inf_x, inf_r = torch.isinf(x), torch.isinf(ref)
    assert torch.equal(inf_x, inf_r) and torch.equal(x[inf_r], ref[inf_r]), (
        f"{name}: infinities differ at {(inf_x != inf_r).nonzero()[:4].tolist()}; {p}")
    fin = ~(nan_r | inf_r)
    err = (x[fin] - ref[fin]).norm().item()
    bound = tol_scale * (tol * ref[fin].norm().item() + floor * math.sqrt(fin.sum().item()))
    assert err <= bound, f"{name}: ||x - ref|| = {err:.3g} > {bound:.3g}; {p}"


def assert_matches(p: Problem, got, ref=None, tol_scale=1.0):
    """``got`` = (out, lse, grad_q, grad_kv, grad_sink), any of the trailing ones may be
    missing (forward only); compared with ``oracle(p)``."""
    ref = oracle(p) if ref is None else ref
    dtype = p.q.dtype
    D = p.q.shape[-1]
    # The backward's rounding noise (Delta from the rounded out, dS rounded for the tensor
    # cores) grows with the logits' spread: scale * sqrt(D) is 1 at the default scale.
    sharp = 1.0 if p.scale is None or not D else max(1.0, p.scale * D ** 0.5)
    for name, x, r in zip(("out", "lse", "grad_q", "grad_kv", "grad_sink"), got, ref):
        d = "lse" if name == "lse" and dtype != F64 else dtype
        assert_close(name, x, r, d, p, tol_scale * (sharp if name.startswith("grad") else 1.0))
