"""``python -m dsv4_sparse_attn``: the installed versions and, for this machine, which
kernel runs each op for each head-dim and head-count range, and why the kernels before
it in the dispatcher's order do not.

    python -m dsv4_sparse_attn            # the first CUDA device, else what a CPU call runs
    python -m dsv4_sparse_attn --device cuda:1
"""
from __future__ import annotations

import argparse
import platform

import torch
import triton

from . import __version__
from .kernels import dispatch
from .kernels.common import Call
from .kernels.hopper import gluon_unavailable

# One head count per range where a rule changes (forward_gluon.MIN_HEADS = 17, 64-row tiles).
HEAD_RANGES = (("1-16", 16), ("17-63", 32), (">=64", 128))
# (label, D, d_v (0: D), topk_length given): the head dims, the V3.2 layout (576 scored, 512
# values) and per-token lengths.
HEAD_DIMS = (("64", 64, 0, False), ("128", 128, 0, False), ("256", 256, 0, False), ("512", 512, 0, False),
             ("512 +len", 512, 0, True), ("576", 576, 0, False), ("576/512", 576, 512, False))


def report(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    lines = [
        f"dsv4_sparse_attn {__version__}",
        f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}"
        f" (Gluon: {'available' if gluon_unavailable() is None else gluon_unavailable()})",
    ]
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        lines.append(f"device {device}: {p.name}, compute capability {p.major}.{p.minor}, "
                     f"{p.multi_processor_count} SMs")
    else:
        lines.append("device cpu: every op runs the exact PyTorch reference (the CUDA kernels need a GPU)")
        return "\n".join(lines)
    dtype_name = str(dtype).replace("torch.", "")
    lines.append(f"\nkernels for {dtype_name} inputs (first that takes the call runs it):")
    lines.append(f"{'op':<22} {'D(/d_v)':>8} {'H':>6}  kernel       why not the ones before it")
    for op, direction, det in (("sparse_mla_fwd", "forward", True),
                               ("sparse_mla_bwd fast", "backward", False),
                               ("sparse_mla_bwd determ.", "backward", True)):
        for d_label, D, d_v, has_len in HEAD_DIMS:
            for label, H in HEAD_RANGES:
                rows = dispatch.candidates(direction, Call(device, dtype, D, H, det, d_v, has_len))
                name = next(n for n, m, r in rows if r is None)
                why = "; ".join(f"{n}: {r}" for n, m, r in rows if r)
                lines.append(f"{op:<22} {d_label:>8} {label:>6}  {name:<12} {why}")
    summary = _gluon_backward_options()
    if summary:
        lines.append(f"\nGluon backward (fast mode) under triton {triton.__version__}: {summary}")
    mode = "deterministic" if dispatch.deterministic_backward() else "fast"
    lines.append(f"\nbackward mode now: {mode} (dsv4_sparse_attn.set_deterministic_backward, "
                 "torch.use_deterministic_algorithms)")
    return "\n".join(lines)


def _gluon_backward_options() -> str | None:
    """What the Gluon backward's fast mode runs under this Triton (None: no Gluon here)."""
    mod, _ = dispatch.kernel_module("backward_gluon")
    return mod.options_summary() if mod is not None else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dsv4_sparse_attn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    print(report(dev))


if __name__ == "__main__":
    main()
