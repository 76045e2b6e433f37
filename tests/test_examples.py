"""examples/: the training example runs from the command line and writes its loss PNG
(or says how to get one without matplotlib); the demo runs and matches the oracle."""
from __future__ import annotations

import os
import re
import struct
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def png_size(path):
    """(width, height) of a PNG; checks the signature and that IHDR comes first."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def run_train_block(*args, block_matplotlib=False):
    argv = [os.path.join(EXAMPLES, "train_block.py"), "--device", "cpu", *args]
    if block_matplotlib:  # as if matplotlib were not installed
        code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        cmd = [sys.executable, "-c", code, *argv]
    else:
        cmd = [sys.executable, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_train_block_example(tmp_path):
    pytest.importorskip("matplotlib", reason="the loss PNG needs matplotlib (the 'plot' extra)")
    out = tmp_path / "loss.png"
    proc = run_train_block("--steps", "60", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"loss: first \d+ steps ([0-9.]+) -> last \d+ steps ([0-9.]+)", proc.stdout)
    assert m, proc.stdout
    first, last = float(m.group(1)), float(m.group(2))
    assert last < 0.8 * first, (first, last)
    assert "60/60" in proc.stdout and f"wrote {out}" in proc.stdout
    assert png_size(out) == (800, 480)


def test_train_block_without_matplotlib(tmp_path):
    out = tmp_path / "loss.png"
    proc = run_train_block("--steps", "2", "--out", str(out), block_matplotlib=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pip install dsv4_sparse_attn[plot]" in proc.stdout and "wrote" not in proc.stdout
    assert "2/2" in proc.stdout and not out.exists()


def test_demo():
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "demo.py")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "device cpu" in proc.stdout:
        assert "kernels: forward PyTorch reference (CPU); backward PyTorch reference (CPU)" in proc.stdout
    else:
        assert re.search(r"kernels: forward (gluon_sm90|triton); backward (gluon_sm90|triton), (fast|deter)",
                         proc.stdout), proc.stdout
    errs = [float(e) for e in re.findall(r"(?:out|lse|dq|dkv|dsink) ([0-9.]+e[-+][0-9]+)", proc.stdout)]
    assert len(errs) == 5 and max(errs) < 2e-2, proc.stdout  # bf16 against the float64 oracle
