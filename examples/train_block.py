"""Train a DeepSeek-V4-style sparse-MLA attention block on synthetic data, plot the loss.

    python examples/train_block.py --steps 300 --out loss.png

A student ``SparseMLAAttention`` learns to reproduce a fixed, randomly initialised
teacher block of the same shape. Every step draws fresh inputs and DeepSeek-style
indices: each token sees a causal window of its last W positions plus randomly chosen
earlier positions (standing in for the indexer's top-k), -1 where there is none. The
loss is the mean squared error normalised by the teacher's output variance (1.0 ~ a
student that predicts the mean).

On a CUDA GPU: bf16 autocast (fp32 master weights, bf16 q and kv) with D=512, so the
Triton forward and backward kernels do the attention. On the CPU: a small fp32 block
running the PyTorch reference (about a minute for 300 steps on two cores).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

import torch

from dsv4_sparse_attn import SparseMLAAttention
from dsv4_sparse_attn.testing import causal_indices

# name: (dim, heads H, head dim D, batch B, sequence S, slots K, causal window W, lr)
# Adam moves every weight by about lr per step, so a stable lr shrinks with the fan-in of
# the output projection (H * D): lr * H * D of about 2.5 works for both.
CONFIGS = {
    "cuda": (512, 16, 512, 4, 1024, 256, 128, 3e-4),   # DeepSeek-V4's head dim; 16 heads (V4-Pro at TP=8)
    "cpu": (128, 8, 64, 2, 128, 40, 16, 5e-3),         # small: the CPU runs the reference
}


class ProgressBar:
    """``[#####.....] 120/300  loss 0.1234  9.8 it/s``: redrawn in place on a terminal,
    a line every 10% otherwise (logs, CI)."""

    def __init__(self, total: int, width: int = 30, stream=sys.stdout):
        self.total, self.width, self.stream = total, width, stream
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()
        self.every = max(1, total // 10)

    def update(self, done: int, **fields: float) -> None:
        if not self.tty and done % self.every and done != self.total:
            return
        filled = self.width * done // self.total
        rate = done / max(1e-9, time.perf_counter() - self.t0)
        info = "  ".join(f"{k} {v:.4f}" for k, v in fields.items())
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total}  {info}  {rate:.1f} it/s"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        if self.tty and done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def smooth(xs, n: int):
    """Centred moving average over up to 2n+1 points (fewer at the ends)."""
    prefix = [0.0]
    for x in xs:
        prefix.append(prefix[-1] + x)
    out = []
    for i in range(len(xs)):
        lo, hi = max(0, i - n), min(len(xs), i + n + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="loss.png", help="loss-curve PNG to write")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dim, H, D, B, S, K, W, lr = CONFIGS["cuda" if device.startswith("cuda") else "cpu"]
    lr = args.lr if args.lr is not None else lr
    if device == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)

    teacher = SparseMLAAttention(dim, H, D, device=device)
    with torch.no_grad():
        teacher.attn_sink.normal_()
        teacher.wq.weight.mul_(2.0)  # sharper attention than the default init gives
    teacher.requires_grad_(False)
    student = SparseMLAAttention(dim, H, D, device=device)
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda")
           else contextlib.nullcontext())

    precision = "bf16 autocast, GPU kernels" if device.startswith("cuda") else "fp32, PyTorch reference"
    print(f"device {device} ({precision}): dim={dim} H={H} D={D} B={B} S={S} K={K} "
          f"(window {W} + {K - W} random), AdamW lr={lr}, {args.steps} steps")
    bar = ProgressBar(args.steps)
    losses = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(B, S, dim, device=device, generator=gen)
        idx = causal_indices((B, S), K, W, device=device, generator=gen)
        with amp:
            with torch.no_grad():
                y_t = teacher(x, idx).float()
            y = student(x, idx).float()
        loss = (y - y_t).square().mean() / y_t.var()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.update(step, loss=losses[-1])
    elapsed = time.perf_counter() - t0

    k = max(1, min(20, len(losses) // 5))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss: first {k} steps {first:.4f} -> last {k} steps {last:.4f}  "
          f"({elapsed:.1f} s, {elapsed / max(1, len(losses)) * 1e3:.1f} ms/step)")
    title = (f"SparseMLAAttention learning a teacher block\n"
             f"{device} ({precision}): H={H}, D={D}, B={B}, S={S}, K={K}, AdamW lr={lr}")
    if plot_loss(args.out, losses, smooth(losses, k // 2), title):
        print(f"wrote {args.out}")
    return losses


def plot_loss(path: str, losses: list, smoothed: list, title: str) -> bool:
    """The loss curve as a PNG (log-scale loss against step); False, with a hint, without
    matplotlib."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no display, no global state
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print(f"matplotlib is not installed: no {path} (pip install dsv4_sparse_attn[plot] for the PNG)")
        return False
    steps = range(1, len(losses) + 1)
    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.subplots()
    ax.plot(steps, losses, color="#a9c4eb", linewidth=1.0, label="loss per step")
    ax.plot(steps, smoothed, color="#1f4e9c", linewidth=2.0, label="moving average")
    ax.set_yscale("log")  # the loss falls over orders of magnitude
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 0.5, 1, 2 rather than 5x10^-1
    ax.yaxis.set_major_formatter(plain)
    finite = [x for x in losses if x > 0 and math.isfinite(x)]
    if finite and max(finite) / min(finite) < 100:  # under two decades: label the minor ticks too
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=8)
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("loss (MSE / teacher variance, log scale)", fontsize=11)
    ax.set_title(title, fontsize=11)
    ax.set_xlim(1, max(2, len(losses)))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=10)
    fig.savefig(path, dpi=100)
    return True


if __name__ == "__main__":
    main()
