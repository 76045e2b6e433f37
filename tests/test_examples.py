"""examples/: the training example runs from the command line and writes a valid loss PNG."""
from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import zlib

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

from _png_plot import Canvas, line_plot_png  # noqa: E402


def read_png(path):
    """Decode the PNGs _png_plot writes (8-bit RGB, filter 0): (width, height, rows of bytes).
    Checks the signature, every chunk's CRC and the chunk order."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, kinds, idat = 8, [], b""
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body), kind
        kinds.append(kind)
        if kind == b"IHDR":
            w, h, depth, color, _, _, _ = struct.unpack(">IIBBBBB", body)
            assert (depth, color) == (8, 2)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    raw = zlib.decompress(idat)
    assert len(raw) == h * (1 + 3 * w)
    rows = [raw[y * (1 + 3 * w):(y + 1) * (1 + 3 * w)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return w, h, [r[1:] for r in rows]


def test_png_writer(tmp_path):
    cv = Canvas(5, 4)
    cv.set(1, 2, (10, 20, 30))
    path = tmp_path / "tiny.png"
    path.write_bytes(cv.png())
    w, h, rows = read_png(path)
    assert (w, h) == (5, 4)
    assert rows[2][3:6] == bytes([10, 20, 30]) and rows[0][:3] == bytes([255, 255, 255])

    plot = tmp_path / "plot.png"
    line_plot_png(str(plot), [([3.0, 2.0, 1.0, float("nan"), 0.5], (200, 0, 0))], log_y=True,
                  title="test", legend=("loss",), width=200, height=120)
    w, h, rows = read_png(plot)
    assert (w, h) == (200, 120)
    assert any(bytes([200, 0, 0]) in r for r in rows), "the series was not drawn"
    with pytest.raises(ValueError, match="nothing finite"):
        line_plot_png(str(plot), [([float("nan")], (0, 0, 0))])


def test_train_block_example(tmp_path):
    out = tmp_path / "loss.png"
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "train_block.py"), "--steps", "60", "--device", "cpu",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"loss: first \d+ steps ([0-9.]+) -> last \d+ steps ([0-9.]+)", proc.stdout)
    assert m, proc.stdout
    first, last = float(m.group(1)), float(m.group(2))
    assert last < 0.8 * first, (first, last)
    assert "60/60" in proc.stdout and f"wrote {out}" in proc.stdout
    w, h, _ = read_png(out)
    assert (w, h) == (720, 440)
