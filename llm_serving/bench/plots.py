"""PNG plots of a load-test run, drawn by matplotlib's Agg backend.

Three files, named after the run's ``<qps>_x`` suffix: ``latency_cdf_*`` (the distribution of TTFT, TPOT, ITL
and end-to-end latency, on a log axis when the samples span more than a decade), ``throughput_*`` (output
tokens and completed requests per second over time) and ``running_batch_*`` (requests in flight as the client
sees them, and the server's running-batch gauge when its /metrics has one).

matplotlib is slow to import, so the client imports this module only when it draws. Figures are made without
pyplot and rendered by an Agg canvas of their own: no global backend is switched and nothing stays open.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from llm_serving.bench.metrics import LATENCIES, in_flight, latency_samples

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from llm_serving.bench.results import RequestResult

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd")  # series colours, in order
DPI = 100
LOG_SPAN = 10.0  # a latency axis goes logarithmic when max / min of the positive samples exceeds this
_SHORT = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


@dataclass
class Series:
    label: str
    xs: np.ndarray
    ys: np.ndarray
    step: bool = False  # draw as a step function (value holds until the next x)


def _cdf(samples: np.ndarray, max_points: int = 2000) -> Series:
    """The empirical CDF, thinned to ``max_points`` quantiles so large runs keep small files."""
    s = np.sort(samples)
    frac = np.arange(1, s.size + 1) / max(s.size, 1)
    if s.size > max_points:
        keep = np.linspace(0, s.size - 1, max_points).astype(np.int64)
        s, frac = s[keep], frac[keep]
    return Series(f"{samples.size} samples", s, frac, step=True)


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
    return Series("output tokens/s", mids, tok / width), Series("completed requests/s", mids, req / width)


def _no_data(ax: Axes) -> None:
    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _draw(ax: Axes, series: Sequence[Series]) -> bool:
    """Draw the non-empty series in palette order with a legend; False (and "no data") when all are empty."""
    live = [s for s in series if len(s.xs)]
    if not live:
        _no_data(ax)
        return False
    for i, s in enumerate(live):
        color = PALETTE[i % len(PALETTE)]
        if s.step:
            ax.step(s.xs, s.ys, where="post", color=color, linewidth=2, label=s.label)
        else:
            ax.plot(s.xs, s.ys, color=color, linewidth=2, label=s.label)
    ax.grid(True, alpha=0.3)
    return True


def _latency_panel(ax: Axes, key: str, title: str, samples: np.ndarray) -> None:
    ax.set_title(f"{_SHORT[key]} CDF: {title}", fontsize=11)
    if not _draw(ax, [_cdf(samples)]):
        return
    for p, style in ((50, ":"), (99, "--")):
        value = float(np.percentile(samples, p))
        ax.axvline(value, color="grey", linestyle=style, linewidth=1, label=f"p{p} {value:.4g} ms")
    positive = samples[samples > 0]
    if positive.size and positive.max() > LOG_SPAN * positive.min():
        ax.set_xscale("log")  # zero gaps (chunks read together) sit at the left edge
    ax.set_xlabel("latency (ms)" + (", log scale" if ax.get_xscale() == "log" else ""))
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right", fontsize=9)


def _time_panel(ax: Axes, title: str, ylabel: str, series: Sequence[Series], duration: float,
                integer: bool = False) -> None:
    ax.set_title(title, fontsize=11)
    if not _draw(ax, series):
        return
    ax.set_xlim(0, max(duration, max(float(np.max(s.xs)) for s in series if len(s.xs)), 1e-3))
    ax.set_ylim(0, ax.get_ylim()[1] * 1.2 or 1.0)  # headroom for the legend
    if integer:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel(ylabel)
    ax.legend(loc="upper right", fontsize=9)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)  # binds the figure to an Agg canvas without touching pyplot's global backend
    fig.savefig(path, dpi=DPI, format="png")
    return path


def write_plots(results: Sequence[RequestResult], duration: float, out_dir: str | Path, suffix: str,
                server_batch: Sequence[tuple[float, float]] = ()) -> list[Path]:
    """Write latency CDFs, throughput over time and running batch over time; return the PNG paths."""
    out = Path(out_dir)
    samples = latency_samples(results)

    cdf = Figure(figsize=(12.8, 8.4), dpi=DPI, layout="constrained")
    cdf.suptitle("Latency distributions (successful requests)")
    for ax, (key, title) in zip(cdf.subplots(2, 2).flat, LATENCIES):
        _latency_panel(ax, key, title, samples[key])

    tok, req = throughput_series(results, duration)
    thr = Figure(figsize=(9.0, 8.4), dpi=DPI, layout="constrained")
    top, bottom = thr.subplots(2, 1)
    _time_panel(top, "Output token throughput", "tokens/s", [tok], duration)
    _time_panel(bottom, "Completed requests", "requests/s", [req], duration)

    t, n = in_flight(results)
    batch = [Series("client: requests in flight", t, n, step=True)]
    if server_batch:
        batch.append(Series("server: running batch (/metrics)", np.array([s[0] for s in server_batch]),
                            np.array([s[1] for s in server_batch]), step=True))
    run = Figure(figsize=(9.0, 4.2), dpi=DPI, layout="constrained")
    _time_panel(run.subplots(), "Running batch", "requests", batch, duration, integer=True)

    return [_save(cdf, out / f"latency_cdf_{suffix}.png"), _save(thr, out / f"throughput_{suffix}.png"),
            _save(run, out / f"running_batch_{suffix}.png")]
