"""Choose, for a CUDA call, the Triton kernel or (for shapes it cannot take) the reference.

A call the kernels cannot take (float32/float64 inputs, a head dim outside
SUPPORTED_D) runs the exact reference on the GPU after a one-time warning: slower,
never wrong.
"""
from __future__ import annotations

from .. import reference
from . import backward as _bwd
from . import forward as _fwd
from .common import unsupported_reason, warn_once

_deterministic = True


def set_deterministic_backward(enabled: bool) -> None:
    """Deterministic backward (the default): bitwise-identical gradients run to run.

    ``False`` opts into fp32 atomic adds for grad_kv: faster, but the last bits of
    grad_kv vary between runs (see README, benchmarks/NOTES.md).
    """
    global _deterministic
    _deterministic = bool(enabled)


def deterministic_backward() -> bool:
    return _deterministic


def _fallback(which: str, q, D: int) -> bool:
    reason = unsupported_reason(q, D)
    if reason is None:
        return False
    warn_once(
        f"{which}:{reason}",
        f"dsv4.sparse_mla_{which}: the Triton kernels do not take {reason}; "
        "running the PyTorch reference on the GPU instead (correct, much slower).",
    )
    return True


def forward(q, kv, indices, attn_sink, p):
    if _fallback("fwd", q, p.D):
        return reference.sparse_mla_fwd(q, kv, indices, attn_sink, p.scale)
    return _fwd.sparse_mla_fwd(q, kv, indices, attn_sink, p.scale)


def backward(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, p):
    if _fallback("bwd", q, p.D):
        return reference.sparse_mla_bwd(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, p.scale)
    return _bwd.sparse_mla_bwd(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, p.scale,
                               deterministic=_deterministic)
