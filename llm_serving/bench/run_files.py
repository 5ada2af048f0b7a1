"""A run's files: ``result_<qps>_x.json`` (per request, the contest's fields first), a summary json, the
markdown report and the PNG plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llm_serving.bench import report
from llm_serving.bench.results import RequestResult


def save_results(out_dir: str | Path, qps: float, results: Sequence[RequestResult], duration: float,
                 server_batch: Sequence[tuple[float, float]], metrics: dict[str, Any], settings: dict[str, Any],
                 draw: bool = True) -> dict[str, Path]:
    """Write result_<qps>_x.json (per request), summary json, markdown report and PNG plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"{float(qps)}_x"  # the contest names its file result_{x}_x.json with x a float
    paths = {"results": out / f"result_{suffix}.json", "summary": out / f"summary_{suffix}.json",
             "report": out / f"report_{suffix}.md"}
    paths["results"].write_text(json.dumps([r.to_json() for r in results], ensure_ascii=False))
    summary = {"settings": settings, "metrics": metrics, "server_running_batch": server_batch}
    paths["summary"].write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    pngs = []
    if draw:
        from llm_serving.bench import plots  # matplotlib takes a while to import: only when drawing

        pngs = plots.write_plots(results, duration, out, suffix, server_batch)
    paths.update({p.stem: p for p in pngs})
    paths["report"].write_text(report.markdown_report(metrics, settings, [p.name for p in pngs]))
    return paths
