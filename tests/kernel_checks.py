"""Kernel-vs-oracle checks shared by the GPU tests and the CPU interpreter tests.

Each check draws fresh random inputs, poisons the kernel's outputs (NaN) before the
launch, runs a launcher directly (the Triton kernels unless told otherwise) and compares
with the float64 reference.
"""
from __future__ import annotations

import types
import zlib
from dataclasses import dataclass

import torch

from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_triton
from dsv4_sparse_attn.kernels import forward_triton as kfwd
from helpers import deepseek_indices, oracle_bwd, oracle_fwd, relerr

TOL = {  # relative-error bounds against the float64 oracle
    torch.bfloat16: dict(out=2e-2, lse=1e-3, grad=3e-2, sink=2e-2),
    torch.float16: dict(out=4e-3, lse=2e-4, grad=6e-3, sink=4e-3),
}


@dataclass(frozen=True)
class Case:
    T: int
    H: int
    D: int
    N: int
    K: int
    dtype: torch.dtype = torch.bfloat16
    sink: bool = True
    ids: str = "random"  # random | empty_rows | dup | extreme | shared | deepseek | tails
    idx_dtype: torch.dtype = torch.int32
    noncontig: bool = False
    sink_scale: float = 1.0
    lengths: bool = False  # a per-token topk_length (make_lengths)

    def __str__(self):
        d = str(self.dtype).replace("torch.", "")
        i = str(self.idx_dtype).replace("torch.", "")
        return (f"T{self.T}-H{self.H}-D{self.D}-N{self.N}-K{self.K}-{d}-{i}-{self.ids}"
                f"{'-sink' if self.sink else ''}{'-nc' if self.noncontig else ''}"
                f"{'-sink%g' % self.sink_scale if self.sink_scale != 1 else ''}"
                f"{'-len' if self.lengths else ''}")


def make_indices(c: Case, device) -> torch.Tensor:
    T, N, K = c.T, c.N, c.K
    if c.ids == "deepseek":
        return deepseek_indices(T, K, window=min(128, K), n_pool=max(1, N - T), device=device,
                                dtype=c.idx_dtype).clamp(max=N - 1)
    if c.ids == "shared":  # every token selects the same few rows (heavy dKV sharing)
        idx = torch.randint(0, min(N, 3), (T, K), device=device)
    else:
        idx = torch.randint(-2, N + 2, (T, K), device=device)  # some masked / out of range
    if c.ids == "empty_rows":
        idx[:: 2] = -1
    elif c.ids == "dup":
        idx[:, : K // 2] = idx[:, :1]
    elif c.ids == "extreme":
        big = 2**31 - 1 if c.idx_dtype == torch.int32 else 2**40
        idx[:, 0::3] = big
        idx[:, 1::3] = -big
    elif c.ids == "tails":  # as a causal indexer's: each token's slots from a cut on masked
        # (-1 and >= N in turn), the cut uniform in [0, K] with 0, 1 and K among them;
        # masked and out-of-range ids before the cut too
        cut = torch.randint(0, K + 1, (T, 1), device=device)
        cut[:3, 0] = torch.tensor([0, 1, K], device=device)[:T]
        pos = torch.arange(K, device=device)[None, :]
        idx = torch.where(pos >= cut, torch.where(pos % 2 == 0, -1, N + 3), idx)
    return idx.to(c.idx_dtype)


def trailing_lengths(idx: torch.Tensor, N: int) -> torch.Tensor:
    """int64 [T]: 1 + each token's last slot with an id in [0, N) (0 where none is)."""
    valid = (idx >= 0) & (idx < N)
    if idx.shape[1] == 0:
        return torch.zeros(idx.shape[0], dtype=torch.int64, device=idx.device)
    return (valid * torch.arange(1, idx.shape[1] + 1, device=idx.device)).amax(1)


def stand_in(module, **overrides):
    """A copy of a main-kernel module (``backward_triton``) with ``overrides``: the tests'
    stand-in for a main kernel with other launch options or defaults."""
    main = types.SimpleNamespace(**{k: getattr(module, k) for k in dir(module) if not k.startswith("__")})
    for k, v in overrides.items():
        setattr(main, k, v)
    return main


def make_case(c: Case, device, requires_grad=False):
    # Seeded per case: a failure reproduces. (fp16 with sink +-30 puts P near the fp16
    # underflow, where some draws land at the edge of the tolerance.)
    torch.manual_seed(zlib.crc32(str(c).encode()))

    def noncontig(x):  # a strided view with the same values (every other row of a 2x tensor)
        if not c.noncontig:
            return x
        y = torch.empty((x.shape[0] * 2,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        y[::2] = x
        return y[::2]

    q = noncontig(torch.randn(c.T, c.H, c.D, device=device).to(c.dtype))
    kv = noncontig(torch.randn(c.N, c.D, device=device).to(c.dtype))
    idx = noncontig(make_indices(c, device))
    sink = (torch.randn(c.H, device=device) * c.sink_scale).float() if c.sink else None
    if c.noncontig and sink is not None:  # a strided [H] view: heads are not base + h
        sink = torch.stack([sink, torch.full_like(sink, 1e4)], 1).reshape(-1)[::2]
    return q, kv, idx, sink


def make_lengths(c: Case, device):
    """topk_length for a ``lengths`` case (else None): int32 [T], uniform in [-2, K + 2]
    (the kernels clamp to [0, K]), with 0, 1 and K among them; seeded per case."""
    if not c.lengths:
        return None
    g = torch.Generator().manual_seed(zlib.crc32(str(c).encode()) + 1)
    length = torch.randint(-2, c.K + 3, (c.T,), generator=g, dtype=torch.int32)
    length[: 3] = torch.tensor([0, 1, c.K], dtype=torch.int32)[: c.T]
    return length.to(device)


def run_forward(c: Case, device, fwd=None):
    """``fwd``: the launcher under test (default: the Triton kernel)."""
    fwd = fwd or kfwd.sparse_mla_fwd
    q, kv, idx, sink = make_case(c, device)
    length = make_lengths(c, device)
    out = torch.full((c.T, c.H, c.D), float("nan"), dtype=c.dtype, device=device)
    lse = torch.full((c.T, c.H), float("nan"), dtype=torch.float32, device=device)
    fwd(q, kv, idx, sink, c.D ** -0.5, out=out, lse=lse, topk_length=length)
    ro, rl = oracle_fwd(q, kv, idx, sink, None, length)
    return dict(out=relerr(out, ro), lse=relerr(lse, rl)), (q, kv, idx, sink, out, lse)


def check_forward(c: Case, device, fwd=None):
    errs, (q, kv, idx, sink, out, lse) = run_forward(c, device, fwd)
    tol = TOL[c.dtype]
    assert errs["out"] < tol["out"], (str(c), errs)
    assert errs["lse"] < tol["lse"], (str(c), errs)
    if c.ids == "empty_rows":
        assert torch.all(out[::2] == 0), "empty rows must give out == 0"
        want = sink[None, :].expand(lse[::2].shape) if sink is not None else torch.full_like(
            lse[::2], float("-inf"))
        # lse = sink up to the rounding of the base-2 round trip (sink*log2e*ln2)
        torch.testing.assert_close(lse[::2], want, rtol=1e-6, atol=1e-6,
                                   msg="empty rows must give lse == sink (or -inf)")
    return errs


def check_backward(c: Case, device, deterministic=True, with_dlse=True, main=None, exact=None,
                   partial16=False):
    """``main``: the backward's main-kernel module (default ``backward_triton``; the GPU
    tests also pass ``backward_gluon``); ``exact``, ``partial16``: the deterministic mode's
    sums and partial rows (``backward.sparse_mla_bwd``)."""
    q, kv, idx, sink = make_case(c, device)
    length = make_lengths(c, device)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, c.D ** -0.5, topk_length=length)
    do = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    if c.noncontig:  # strided head dims, like gradients autograd hands over
        do = torch.stack([do, torch.full_like(do, 1e4)], 2).flatten(1, 2)[:, ::2]
        if dlse is not None:
            dlse = torch.stack([dlse, torch.full_like(dlse, 1e4)], 2).flatten(1)[:, ::2]
        out = torch.stack([out, torch.full_like(out, 1e4)], 2).flatten(1, 2)[:, ::2]
        lse = torch.stack([lse, torch.full_like(lse, 1e4)], 2).flatten(1)[:, ::2]
    dq = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    gq, gkv, gs = kbwd.sparse_mla_bwd(do, dlse, q, kv, out, lse, idx, sink, c.D ** -0.5,
                                      main=main or backward_triton, deterministic=deterministic, grad_q=dq,
                                      topk_length=length, exact=exact, partial16=partial16)
    rq, rkv, rs = oracle_bwd(do, dlse, q, kv, idx, sink, None, length)
    tol = TOL[c.dtype]
    errs = dict(dq=relerr(gq, rq), dkv=relerr(gkv, rkv))
    if sink is not None:
        errs["dsink"] = relerr(gs, rs)
        assert errs["dsink"] < tol["sink"], (str(c), errs)
    else:
        assert gs.numel() == 0
    assert errs["dq"] < tol["grad"], (str(c), errs)
    assert errs["dkv"] < tol["grad"], (str(c), errs)
    if c.ids == "empty_rows":
        assert torch.all(gq[::2] == 0), "empty rows must give zero grad_q"
    return errs
