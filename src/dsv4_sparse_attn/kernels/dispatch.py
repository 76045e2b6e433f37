"""Which kernel runs a CUDA call: one ordered list of candidates per direction.

    forward:  gluon_sm90 (forward_gluon)  -> triton (forward_triton)  -> reference
    backward: gluon_sm90 (backward_gluon) -> triton (backward_triton) -> reference

The first candidate whose ``rejects(call)`` returns None runs the call; ``rejects`` is
each kernel's whole rule (head counts, D, dtypes, architecture), with its reasons, and
docs/design.md#dispatch lists them. The reference is exact and always takes the call:
slower, never wrong (a one-time warning says why it ran). A Gluon kernel that fails to
build at its first launch (Gluon's API moves between Triton releases) is dropped for the
rest of the process after a one-time warning naming the kernel, the Triton version and
the reason; any other error of a launch (out of memory, a CUDA error) reaches the caller.

The backward's mode: deterministic (bitwise-identical gradients run to run) when
``set_deterministic_backward(True)`` or, by default, when
``torch.use_deterministic_algorithms(True)`` is on; otherwise the fast mode (fp32 atomic
adds into grad_kv; docs/design.md#backward-determinism has the cost of each).
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Iterator, Optional

import torch
import triton
from triton.errors import TritonError

from .. import reference
from . import backward as _backward
from .common import Call, warn_once

REFERENCE = "reference"
# Candidate modules in order of preference; each has NAME, rejects(call) and its launcher.
CANDIDATES = {
    "forward": ("forward_gluon", "forward_triton"),
    "backward": ("backward_gluon", "backward_triton"),
}

_deterministic: Optional[bool] = None
_broken: dict = {}  # module -> why it cannot be built here (set at its first failed launch)
_forced: dict = {}  # direction -> kernel name (use_kernels)


def set_deterministic_backward(enabled: Optional[bool]) -> None:
    """``True``: the backward is deterministic (bitwise-identical gradients run to run and
    for any chunking of T; slower, see the README). ``False``: the fast mode (fp32 atomic
    adds, last bits of grad_kv vary). ``None`` (the default): deterministic exactly when
    ``torch.are_deterministic_algorithms_enabled()``."""
    global _deterministic
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_deterministic_backward takes True, False or None, got {enabled!r}")
    _deterministic = enabled


def deterministic_backward() -> bool:
    """Whether the next backward runs in deterministic mode (see ``set_deterministic_backward``)."""
    if _deterministic is not None:
        return _deterministic
    return torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def use_kernels(forward: Optional[str] = None, backward: Optional[str] = None) -> Iterator[None]:
    """Run CUDA calls with the named kernels ("gluon_sm90", "triton" or "reference"),
    for A/B comparisons and debugging. A named kernel that does not take a call raises
    ValueError with its reason instead of falling back."""
    for direction, name in (("forward", forward), ("backward", backward)):
        if name is not None and name != REFERENCE and name not in {
                _NAMES[m] for m in CANDIDATES[direction]}:
            raise ValueError(f"use_kernels: no {direction} kernel named {name!r} "
                             f"(have {sorted(set(_NAMES[m] for m in CANDIDATES[direction])) + [REFERENCE]})")
    saved = dict(_forced)
    _forced.update({k: v for k, v in (("forward", forward), ("backward", backward)) if v is not None})
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


_NAMES = {"forward_gluon": "gluon_sm90", "forward_triton": "triton", "backward_gluon": "gluon_sm90",
          "backward_triton": "triton"}


def kernel_module(mod: str):
    """(The kernel module ``mod`` of this package, None) or (None, the reason it cannot be
    imported here)."""
    try:
        return importlib.import_module(f".{mod}", __package__), None
    except ImportError as e:
        return None, f"cannot be imported with Triton {triton.__version__} ({type(e).__name__}: {e})"


def candidates(direction: str, call: Call) -> list:
    """[(name, module or None, reason or None)] in order of preference, the reference last;
    the first with no reason runs the call (``None`` modules are the reference)."""
    out = []
    for mod_name in CANDIDATES[direction]:
        mod, reason = kernel_module(mod_name)
        reason = reason or _broken.get(mod_name) or mod.rejects(call)
        out.append((_NAMES[mod_name], mod, reason))
    out.append((REFERENCE, None, None))
    return out


_choices: dict = {}


def choose(direction: str, call: Call):
    """(name, module or None for the reference) of the kernel that runs ``call``
    (remembered per call description: the rules read nothing else)."""
    forced = _forced.get(direction)
    key = (direction, call, forced, tuple(sorted(_broken)))
    if key not in _choices:
        _choices[key] = _choose(direction, call, forced)
    return _choices[key]


def _choose(direction: str, call: Call, forced: Optional[str]):
    rows = candidates(direction, call)
    if forced is not None:
        for name, mod, reason in rows:
            if name == forced:
                if reason:
                    raise ValueError(f"dsv4.sparse_mla ({direction}): the {name} kernel does not take "
                                     f"this call: {reason}")
                return name, mod
    name, mod, _ = next(r for r in rows if r[2] is None)
    if mod is None:
        why = "; ".join(f"{n}: {r}" for n, m, r in rows if r)
        warn_once(f"{direction}-reference:{call.dtype}:{call.D}",
                  f"dsv4.sparse_mla ({direction}): no kernel takes this call ({why}); running the PyTorch "
                  "reference on the GPU instead (correct, much slower).")
    return name, mod


def _is_build_error(e: Exception) -> bool:
    """Whether ``e`` says a Gluon kernel cannot be built or launched on this GPU (Triton's
    compile errors, ptxas, too little shared memory, an MLIR pass failure), as opposed to a
    failure of this call (out of memory, a CUDA error, bad input)."""
    return isinstance(e, TritonError) or (isinstance(e, RuntimeError) and "PassManager::run failed" in str(e))


def _run(direction: str, call: Call, run_kernel, run_reference):
    """Run ``call`` with the chosen kernel, on its tensors' GPU (``on_device``) and without
    the deterministic NaN fill (``unfilled_allocations``); a Gluon build failure drops that
    kernel (once, with a warning) and retries with the next candidate."""
    while True:
        name, mod = choose(direction, call)
        if mod is None:
            return run_reference()
        try:
            with on_device(call.device), unfilled_allocations():
                return run_kernel(mod)
        except Exception as e:  # compilation errors surface at the first launch
            if name != "gluon_sm90" or not _is_build_error(e) or _forced.get(direction) == name:
                raise
            mod_name = next(m for m in CANDIDATES[direction] if _NAMES[m] == name)
            _broken[mod_name] = (f"failed to build with Triton {triton.__version__} "
                                 f"({type(e).__name__}: {str(e)[:200]})")
            warn_once(f"gluon-build-{mod_name}",
                      f"dsv4.sparse_mla ({direction}): the Gluon kernel {mod_name} "
                      f"{_broken[mod_name]}; using the next kernel for the rest of the process.")


def _no_work(p) -> bool:
    """A call with no token, head, slot or kv row: every output is a constant (zeros, lse =
    sink or -inf, NaN under a NaN sink) that the reference gives exactly, with no launch."""
    return min(p.T, p.H, p.K, p.N) == 0


def on_device(device: torch.device):
    """The context a call's kernels run in: its tensors' GPU made current. Triton launches on
    the current device's current stream, and a torch.library kernel is not entered under a
    device guard, so a call on cuda:1 while cuda:0 is current would otherwise run its kernels
    on GPU 0, unordered with the PyTorch work (memsets, sorts) it queues on GPU 1's stream.
    (The reference needs none: PyTorch's own ops guard themselves.)"""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def unfilled_allocations():
    """Under ``torch.use_deterministic_algorithms(True)`` PyTorch fills every new empty tensor
    with NaN (``torch.utils.deterministic.fill_uninitialized_memory``) so that reading one
    uninitialised is reproducible. The kernels write every element they read and every
    output element (the GPU tests poison outputs to check it), so the fills would only cost
    time: the deterministic backward's partial-row buffer (up to 0.9 GiB), grad_q, Delta, the
    sort's buffers, the forward's out. Off while a call's kernels run, restored after (a
    process-wide flag: another thread allocating meanwhile gets no fill either)."""
    det = torch.utils.deterministic
    if not (det.fill_uninitialized_memory and torch.are_deterministic_algorithms_enabled()):
        yield
        return
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        det.fill_uninitialized_memory = True


def _dense(topk_length):
    """The kernels read token t's length at ``LEN + t``: a strided [T] view is copied."""
    return topk_length.contiguous() if topk_length is not None else None


def forward(q, kv, indices, attn_sink, p, topk_length=None):
    def run_reference():
        return reference.sparse_mla_fwd(q, kv, indices, attn_sink, p.scale, topk_length, p.d_v)

    if _no_work(p):
        return run_reference()
    topk_length = _dense(topk_length)
    call = Call.of(q, d_v=p.d_v, has_len=p.has_len)
    return _run("forward", call,
                lambda mod: mod.sparse_mla_fwd(q, kv, indices, attn_sink, p.scale,
                                               topk_length=topk_length, d_v=p.d_v),
                run_reference)


def backward(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, p, topk_length=None):
    def run_reference():
        return reference.sparse_mla_bwd(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, p.scale,
                                        topk_length, p.d_v)

    if _no_work(p):
        return run_reference()
    topk_length = _dense(topk_length)
    det = deterministic_backward()
    call = Call.of(q, det, d_v=p.d_v, has_len=p.has_len)
    return _run("backward", call,
                lambda mod: _backward.sparse_mla_bwd(grad_out, grad_lse, q, kv, out, lse, indices,
                                                     attn_sink, p.scale, main=mod, deterministic=det,
                                                     topk_length=topk_length),
                run_reference)
