"""PNG plots of a run without matplotlib: a numpy canvas with a built-in 5x7 pixel font, a minimal PNG encoder.

Latency CDFs, throughput over time and running batch over time, so they work wherever numpy does.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loadtest.metrics import LATENCIES, in_flight, latency_samples

if TYPE_CHECKING:
    from loadtest.protocol import RequestResult


def encode_png(pixels: np.ndarray) -> bytes:
    """Encode an (H, W, 3) uint8 RGB array as a PNG file (8-bit truecolor, no filtering)."""
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"encode_png needs an (H, W, 3) uint8 array, got {pixels.shape} {pixels.dtype}")
    h, w, _ = pixels.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), pixels.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


# 5x7 glyphs, one hex byte per row (bit 4 = leftmost column). Lowercase letters draw as uppercase.
_GLYPHS = {
    "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F", "3": "1F02040201110E",
    "4": "02060A121F0202", "5": "1F101E0101110E", "6": "0608101E11110E", "7": "1F010204080808",
    "8": "0E11110E11110E", "9": "0E11110F01020C", "A": "0E11111F111111", "B": "1E11111E11111E",
    "C": "0E11101010110E", "D": "1C12111111121C", "E": "1F10101E10101F", "F": "1F10101E101010",
    "G": "0E11101711110F", "H": "1111111F111111", "I": "0E04040404040E", "J": "0702020202120C",
    "K": "11121418141211", "L": "1010101010101F", "M": "111B1515111111", "N": "11111915131111",
    "O": "0E11111111110E", "P": "1E11111E101010", "Q": "0E11111115120D", "R": "1E11111E141211",
    "S": "0F10100E01011E", "T": "1F040404040404", "U": "1111111111110E", "V": "11111111110A04",
    "W": "1111111515150A", "X": "11110A040A1111", "Y": "11110A04040404", "Z": "1F01020408101F",
    ".": "00000000000C0C", "-": "0000000E000000", "+": "0004041F040400", "/": "00010204081000",
    "(": "02040808080402", ")": "08040202020408", ":": "000C0C000C0C00", "%": "18190204081303",
    "_": "0000000000001F", ",": "000000000C0408", "=": "00001F001F0000", " ": "00000000000000",
    "?": "0E110102040004", "x": "0000110A040A11",
}
_FONT = {c: np.array([[(int(g[2 * r:2 * r + 2], 16) >> (4 - col)) & 1 for col in range(5)]
                      for r in range(7)], dtype=bool) for c, g in _GLYPHS.items()}

WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (225, 225, 225)
PALETTE = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189))


class Canvas:
    """An RGB pixel buffer with the few primitives the plots need."""

    def __init__(self, width: int, height: int):
        self.px = np.full((height, width, 3), 255, dtype=np.uint8)

    @property
    def height(self) -> int:
        return self.px.shape[0]

    @property
    def width(self) -> int:
        return self.px.shape[1]

    def _plot(self, xs: np.ndarray, ys: np.ndarray, color: tuple[int, int, int]) -> None:
        keep = (xs >= 0) & (xs < self.width) & (ys >= 0) & (ys < self.height)
        self.px[ys[keep], xs[keep]] = color

    def polyline(self, xs: Sequence[float], ys: Sequence[float], color: tuple[int, int, int],
                 width: int = 1) -> None:
        """Connect consecutive points with straight segments (``width`` pixels thick)."""
        xs, ys = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
        if xs.size == 1:
            xs, ys = np.repeat(xs, 2), np.repeat(ys, 2)
        pts_x, pts_y = [], []
        for x0, y0, x1, y1 in zip(xs[:-1], ys[:-1], xs[1:], ys[1:]):
            n = int(max(abs(x1 - x0), abs(y1 - y0))) + 2
            pts_x.append(np.linspace(x0, x1, n))
            pts_y.append(np.linspace(y0, y1, n))
        if not pts_x:
            return
        px = np.rint(np.concatenate(pts_x)).astype(np.int64)
        py = np.rint(np.concatenate(pts_y)).astype(np.int64)
        for dx in range(width):
            for dy in range(width):
                self._plot(px + dx - width // 2, py + dy - width // 2, color)

    def fill(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        self.px[max(y0, 0):max(y1, 0), max(x0, 0):max(x1, 0)] = color

    def text(self, x: int, y: int, s: str, color: tuple[int, int, int] = BLACK, scale: int = 2,
             align: str = "left") -> None:
        """Draw ``s`` with its top at ``y``; ``align`` says whether ``x`` is its left, center or right."""
        advance = 6 * scale
        if align == "center":
            x -= len(s) * advance // 2
        elif align == "right":
            x -= len(s) * advance
        for i, ch in enumerate(s):
            glyph = _FONT.get(ch, _FONT.get(ch.upper(), _FONT["?"]))
            big = np.kron(glyph, np.ones((scale, scale), dtype=bool))
            ys, xs = np.nonzero(big)
            self._plot(xs + x + i * advance, ys + y, color)

    def to_png(self) -> bytes:
        return encode_png(self.px)


@dataclass
class Series:
    label: str
    xs: np.ndarray
    ys: np.ndarray
    step: bool = False  # draw as a step function (value holds until the next x)


def _nice_ticks(lo: float, hi: float, target: int = 5) -> np.ndarray:
    span = hi - lo
    raw = span / target
    mag = 10.0 ** np.floor(np.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = np.ceil(lo / step - 1e-9) * step
    return np.arange(first, hi + step * 1e-6, step)


def _tick_label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.0e}"
    return f"{v:.3f}".rstrip("0").rstrip(".")


def _range(values: list[np.ndarray], floor: float | None) -> tuple[float, float]:
    lo = min(float(v.min()) for v in values)
    hi = max(float(v.max()) for v in values)
    if floor is not None:
        lo = min(lo, floor)
    if hi - lo < 1e-12:
        hi = lo + (abs(lo) if lo else 1.0)
    return lo, hi


def draw_panel(c: Canvas, box: tuple[int, int, int, int], title: str, xlabel: str,
               series: Sequence[Series], x_floor: float | None = None, y_floor: float | None = 0.0) -> None:
    """A titled line plot with ticks, grid and legend inside ``box`` = (left, top, right, bottom)."""
    left, top, right, bottom = box
    c.text((left + right) // 2, top + 4, title, align="center")
    x0, y0, x1, y1 = left + 90, top + 30, right - 15, bottom - 50  # plot area
    live = [s for s in series if len(s.xs)]
    if not live:
        c.text((x0 + x1) // 2, (y0 + y1) // 2, "no data", align="center")
        return
    xlo, xhi = _range([np.asarray(s.xs, np.float64) for s in live], x_floor)
    ylo, yhi = _range([np.asarray(s.ys, np.float64) for s in live], y_floor)
    yhi += (yhi - ylo) * 0.05

    def sx(v: np.ndarray) -> np.ndarray:
        return x0 + (np.asarray(v, np.float64) - xlo) / (xhi - xlo) * (x1 - x0)

    def sy(v: np.ndarray) -> np.ndarray:
        return y1 - (np.asarray(v, np.float64) - ylo) / (yhi - ylo) * (y1 - y0)

    for t in _nice_ticks(xlo, xhi):
        px = round(float(sx(t)))
        c.polyline([px, px], [y0, y1], GREY)
        c.text(px, y1 + 8, _tick_label(t), align="center")
    for t in _nice_ticks(ylo, yhi):
        py = round(float(sy(t)))
        c.polyline([x0, x1], [py, py], GREY)
        c.text(x0 - 8, py - 7, _tick_label(t), align="right")
    c.polyline([x0, x1, x1, x0, x0], [y0, y0, y1, y1, y0], BLACK)
    c.text((x0 + x1) // 2, y1 + 30, xlabel, align="center")
    for i, s in enumerate(live):
        xs, ys = np.asarray(s.xs, np.float64), np.asarray(s.ys, np.float64)
        if s.step and xs.size > 1:  # hold each value until the next x
            xs, ys = np.repeat(xs, 2)[1:], np.repeat(ys, 2)[:-1]
        color = PALETTE[i % len(PALETTE)]
        c.polyline(sx(xs), sy(ys), color, width=2)
        if len(live) > 1 or s.label:
            ly = y0 + 8 + 20 * i
            c.polyline([x1 - 250, x1 - 220], [ly + 7, ly + 7], color, width=3)
            c.text(x1 - 212, ly, s.label[:17])


def figure(panels: Sequence[tuple[str, str, Sequence[Series]]], cols: int = 2, panel_w: int = 640,
           panel_h: int = 420, x_floor: float | None = None) -> Canvas:
    """Lay out (title, xlabel, series) panels on a grid and draw them (x axes reach down to ``x_floor``)."""
    rows = (len(panels) + cols - 1) // cols
    c = Canvas(panel_w * min(cols, len(panels)), panel_h * rows)
    for i, (title, xlabel, series) in enumerate(panels):
        left, top = (i % cols) * panel_w, (i // cols) * panel_h
        draw_panel(c, (left, top, left + panel_w, top + panel_h), title, xlabel, series, x_floor)
    return c


# ----------------------------------------------------------------------------------------------- plots
def _cdf(samples: np.ndarray, max_points: int = 2000) -> Series:
    s = np.sort(samples)
    if s.size > max_points:  # keep the curve's shape at quantiles, not every sample
        s = s[np.linspace(0, s.size - 1, max_points).astype(np.int64)]
    return Series("", s, np.linspace(0.0, 1.0, s.size) if s.size > 1 else np.ones(s.size), step=False)


def _bin_width(duration: float) -> float:
    return max(duration / 60.0, 0.05)


def throughput_series(results: Sequence[RequestResult], duration: float) -> tuple[Series, Series]:
    """Output tokens/s and completed requests/s per time bin (chunks carry their request's tokens evenly)."""
    width = _bin_width(duration)
    nbins = max(int(np.ceil(max(duration, width) / width)), 1)
    tok, req = np.zeros(nbins), np.zeros(nbins)
    for r in results:
        if not r.success:
            continue
        if r.chunk_times:
            share = r.output_tokens / len(r.chunk_times)
            for t in r.chunk_times:
                tok[min(int(t / width), nbins - 1)] += share
        req[min(int(r.end_time / width), nbins - 1)] += 1
    mids = (np.arange(nbins) + 0.5) * width
    return Series("tokens/s", mids, tok / width), Series("requests/s", mids, req / width)


def write_plots(results: Sequence[RequestResult], duration: float, out_dir: str | Path, suffix: str,
                server_batch: Sequence[tuple[float, float]] = ()) -> list[Path]:
    """Write latency CDFs, throughput over time and running batch over time; return the PNG paths."""
    out = Path(out_dir)
    samples = latency_samples(results)
    cdfs = [(f"{key.upper() if key != 'e2el' else 'E2E LATENCY'} CDF", "ms", [_cdf(samples[key])])
            for key, _ in LATENCIES]
    tok, req = throughput_series(results, duration)
    t, n = in_flight(results)
    batch = [Series("client in flight", t, n, step=True)]
    if server_batch:
        batch.append(Series("server /metrics", np.array([s[0] for s in server_batch]),
                            np.array([s[1] for s in server_batch]), step=True))
    figures = {
        f"latency_cdf_{suffix}.png": figure(cdfs),
        f"throughput_{suffix}.png": figure([("OUTPUT TOKENS/S", "time (s)", [tok]),
                                            ("COMPLETED REQUESTS/S", "time (s)", [req])], cols=1, panel_w=900,
                                           x_floor=0.0),
        f"running_batch_{suffix}.png": figure([("RUNNING BATCH", "time (s)", batch)], cols=1, panel_w=900,
                                              x_floor=0.0),
    }
    paths = []
    for name, canvas in figures.items():
        path = out / name
        path.write_bytes(canvas.to_png())
        paths.append(path)
    return paths
