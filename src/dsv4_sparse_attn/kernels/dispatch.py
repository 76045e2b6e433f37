"""Choose, for a CUDA call, the kernel that runs it.

Forward: the Gluon kernel (``forward_gluon``) on sm_90 for D = 512 and H > 16, the
Triton kernel (``forward``) for the other shapes it takes. Backward: the Triton
kernels (``backward``), whose main kernel is the Gluon one (``backward_gluon``) on sm_90
for D = 512 (deterministic: any H; atomic: H > 16). Each ``supported`` holds the
measured rule. A call no kernel takes (float32/float64 inputs, a
head dim outside SUPPORTED_D) runs the exact reference on the GPU after a one-time
warning: slower, never wrong. If a Gluon kernel fails to build (Gluon's API moves
between Triton releases) the Triton kernel takes over, also after a one-time warning;
any other error of a Gluon launch (out of memory, a CUDA error) reaches the caller.
"""
from __future__ import annotations

from triton.errors import TritonError

from .. import reference
from . import backward as _bwd
from . import forward as _fwd
from .common import unsupported_reason, warn_once

_deterministic = True
_gluon_broken = {"fwd": False, "bwd": False}


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


def _gluon_module(which: str):
    """``forward_gluon`` / ``backward_gluon``, or None (after a warning) if this Triton
    lacks Gluon's Hopper API or the kernel failed to build once."""
    if _gluon_broken[which]:
        return None
    try:
        if which == "fwd":
            from . import forward_gluon as mod
        else:
            from . import backward_gluon as mod
    except ImportError as e:
        _gluon_broken[which] = True
        warn_once(f"gluon-import-{which}", f"dsv4.sparse_mla_{which}: Gluon kernel unavailable ({e}); "
                  "using Triton.")
        return None
    return mod


def _is_build_error(e: Exception) -> bool:
    """Whether ``e`` says the Gluon kernel cannot be built or launched on this GPU
    (Triton's compile errors, ptxas, too little shared memory, an MLIR pass failure),
    as opposed to a failure of this call (out of memory, a CUDA error, bad input):
    only the former hands the shape over to Triton for the rest of the process."""
    return isinstance(e, TritonError) or (isinstance(e, RuntimeError) and "PassManager::run failed" in str(e))


def _run_gluon(which: str, q, p, launch, **rule):
    """``launch(module)`` with the Gluon module of ``which``, or None where that kernel
    does not take the call or cannot be built here (then, once, a warning and the Triton
    kernel for the rest of the process). Any other error reaches the caller."""
    mod = _gluon_module(which)
    if mod is None or not mod.supported(q, p.D, p.H, **rule):
        return None
    try:
        return launch(mod)
    except Exception as e:  # compilation errors surface at the first launch
        if not _is_build_error(e):
            raise
        _gluon_broken[which] = True
        warn_once(f"gluon-build-{which}", f"dsv4.sparse_mla_{which}: Gluon kernel failed to build "
                  f"({type(e).__name__}: {str(e)[:200]}); using the Triton kernel.")
        return None


def forward(q, kv, indices, attn_sink, p):
    if _fallback("fwd", q, p.D):
        return reference.sparse_mla_fwd(q, kv, indices, attn_sink, p.scale)
    res = _run_gluon("fwd", q, p, lambda mod: mod.sparse_mla_fwd(q, kv, indices, attn_sink, p.scale))
    if res is not None:
        return res
    return _fwd.sparse_mla_fwd(q, kv, indices, attn_sink, p.scale)


def backward(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, p):
    if _fallback("bwd", q, p.D):
        return reference.sparse_mla_bwd(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, p.scale)
    res = _run_gluon("bwd", q, p, lambda mod: _bwd.sparse_mla_bwd(
        grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, p.scale, deterministic=_deterministic,
        gluon=True), deterministic=_deterministic)
    if res is not None:
        return res
    return _bwd.sparse_mla_bwd(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, p.scale,
                               deterministic=_deterministic)
