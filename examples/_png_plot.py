"""A minimal line-plot PNG writer: the standard library only (zlib + struct), no matplotlib.

    from _png_plot import line_plot_png
    line_plot_png("loss.png", [(losses, (160, 190, 230)), (smoothed, (20, 60, 160))],
                  log_y=True, title="loss")

An RGB image with a frame, horizontal grid lines with their values, the x range below,
and one polyline per series. Text uses a built-in 5x7 pixel font (digits, '.', '-', '+',
'e' and lowercase letters).
"""
from __future__ import annotations

import math
import struct
import zlib
from typing import List, Sequence, Tuple

Color = Tuple[int, int, int]

# 5x7 glyphs, one string of 7 rows of 5 bits per character.
_FONT = {
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    ".": "00000 00000 00000 00000 00000 01100 01100", "-": "00000 00000 00000 11111 00000 00000 00000",
    "+": "00000 00100 00100 11111 00100 00100 00000", " ": "00000 00000 00000 00000 00000 00000 00000",
    ":": "00000 01100 01100 00000 01100 01100 00000", "(": "00010 00100 01000 01000 01000 00100 00010",
    ")": "01000 00100 00010 00010 00010 00100 01000", ",": "00000 00000 00000 00000 01100 00100 01000",
    "=": "00000 00000 11111 00000 11111 00000 00000", "/": "00001 00010 00010 00100 01000 01000 10000",
    "a": "00000 00000 01110 00001 01111 10001 01111", "b": "10000 10000 10110 11001 10001 10001 11110",
    "c": "00000 00000 01110 10000 10000 10001 01110", "d": "00001 00001 01101 10011 10001 10001 01111",
    "e": "00000 00000 01110 10001 11111 10000 01110", "f": "00110 01001 01000 11100 01000 01000 01000",
    "g": "00000 01111 10001 10001 01111 00001 01110", "h": "10000 10000 10110 11001 10001 10001 10001",
    "i": "00100 00000 01100 00100 00100 00100 01110", "j": "00010 00000 00110 00010 00010 10010 01100",
    "k": "10000 10000 10010 10100 11000 10100 10010", "l": "01100 00100 00100 00100 00100 00100 01110",
    "m": "00000 00000 11010 10101 10101 10001 10001", "n": "00000 00000 10110 11001 10001 10001 10001",
    "o": "00000 00000 01110 10001 10001 10001 01110", "p": "00000 00000 11110 10001 11110 10000 10000",
    "q": "00000 00000 01101 10011 01111 00001 00001", "r": "00000 00000 10110 11001 10000 10000 10000",
    "s": "00000 00000 01110 10000 01110 00001 11110", "t": "01000 01000 11100 01000 01000 01001 00110",
    "u": "00000 00000 10001 10001 10001 10011 01101", "v": "00000 00000 10001 10001 10001 01010 00100",
    "w": "00000 00000 10001 10001 10101 10101 01010", "x": "00000 00000 10001 01010 00100 01010 10001",
    "y": "00000 00000 10001 10001 01111 00001 01110", "z": "00000 00000 11111 00010 00100 01000 11111",
}


class Canvas:
    """An RGB pixel buffer with lines, text and PNG output."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)):
        self.w, self.h = width, height
        self.px = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, c: Color) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(c)

    def line(self, x0: float, y0: float, x1: float, y1: float, c: Color, width: int = 1) -> None:
        """Straight line (sampled every half pixel), ``width`` pixels thick."""
        n = max(1, int(2 * max(abs(x1 - x0), abs(y1 - y0))))
        r0 = -(width // 2)
        for i in range(n + 1):
            x = round(x0 + (x1 - x0) * i / n)
            y = round(y0 + (y1 - y0) * i / n)
            for dx in range(r0, r0 + width):
                for dy in range(r0, r0 + width):
                    self.set(x + dx, y + dy, c)

    def text(self, x: int, y: int, s: str, c: Color = (0, 0, 0), scale: int = 1) -> None:
        """Draw ``s`` with its top-left corner at (x, y); unknown characters are skipped."""
        for ch in s.lower():
            rows = _FONT.get(ch)
            if rows is None:
                continue
            for r, bits in enumerate(rows.split()):
                for col, b in enumerate(bits):
                    if b == "1":
                        for sx in range(scale):
                            for sy in range(scale):
                                self.set(x + col * scale + sx, y + r * scale + sy, c)
            x += 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * self.w * y:3 * self.w * (y + 1)]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def _fmt(v: float) -> str:
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 or v == 0 else f"{v:.1e}"


def line_plot_png(path: str, series: Sequence[Tuple[Sequence[float], Color]], *, log_y: bool = False,
                  title: str = "", x_label: str = "step", legend: Sequence[str] = (),
                  width: int = 720, height: int = 440) -> None:
    """Plot each (ys, color) against x = 0..len(ys)-1 and write a PNG to ``path``.

    ``legend`` names the series (top right). Non-finite values (and, with ``log_y``,
    values <= 0) are skipped.
    """
    def ok(v: float) -> bool:
        return math.isfinite(v) and (v > 0 or not log_y)

    tf = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    vals = [tf(v) for ys, _ in series for v in ys if ok(v)]
    if not vals:
        raise ValueError("line_plot_png: nothing finite to plot")
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    pad = 0.05 * (hi - lo)
    lo, hi = lo - pad, hi + pad
    n = max(len(ys) for ys, _ in series)
    left, right, top, bottom = 80, 20, 36, 44
    pw, ph = width - left - right, height - top - bottom
    cv = Canvas(width, height)

    def X(i: float) -> float:
        return left + pw * (i / max(1, n - 1))

    def Y(v: float) -> float:
        return top + ph * (1 - (v - lo) / (hi - lo))

    # grid: decades (and 2x, 5x when they are few) on a log axis, 5 steps on a linear one
    if log_y:
        ticks: List[float] = []
        for e in range(math.floor(lo), math.ceil(hi) + 1):
            for m in ((1, 2, 3, 5) if hi - lo < 1.2 else (1, 2, 5) if hi - lo < 2.5 else (1,)):
                t = e + math.log10(m)
                if lo <= t <= hi:
                    ticks.append(t)
    else:
        step = 10 ** math.floor(math.log10((hi - lo) / 5))
        step *= next(k for k in (1, 2, 5, 10) if (hi - lo) / (step * k) <= 6)
        ticks = [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]
    for t in ticks:
        y = round(Y(t))
        cv.line(left, y, left + pw, y, (225, 225, 225))
        label = _fmt(10 ** t if log_y else t)
        cv.text(left - 8 - 6 * len(label), y - 3, label, (90, 90, 90))
    cv.line(left, top, left, top + ph, (0, 0, 0))
    cv.line(left, top + ph, left + pw, top + ph, (0, 0, 0))
    cv.line(left, top, left + pw, top, (0, 0, 0))
    cv.line(left + pw, top, left + pw, top + ph, (0, 0, 0))
    cv.text(left, top + ph + 8, "0", (90, 90, 90))
    last = str(n - 1)
    cv.text(left + pw - 6 * len(last), top + ph + 8, last, (90, 90, 90))
    cv.text(left + pw // 2 - 3 * len(x_label), top + ph + 24, x_label, (0, 0, 0))
    if title:
        cv.text(left, 10, title, (0, 0, 0), scale=2)
    for k, (name, (_, color)) in enumerate(zip(legend, series)):
        y = top + 10 + 14 * k
        x = left + pw - 16 - 6 * max(len(n) for n in legend) - 26
        cv.line(x, y + 3, x + 18, y + 3, color, width=3)
        cv.text(x + 26, y, name, (0, 0, 0))

    for ys, color in series:
        prev = None
        for i, v in enumerate(ys):
            if not ok(v):
                prev = None
                continue
            pt = (X(i), Y(tf(v)))
            if prev is not None:
                cv.line(prev[0], prev[1], pt[0], pt[1], color, width=2)
            prev = pt
    with open(path, "wb") as f:
        f.write(cv.png())
