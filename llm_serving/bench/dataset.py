"""An alpaca dataset as a load test reads it: ``[{"instruction", "input", "output"}]`` read and checked, the
contest's prompt of a record, and the default workload standing in for the contest's ``./alpaca_5010.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from llm_serving.bench import BenchError

DEFAULT_DATASET = "./alpaca_5010.json"


def default_dataset(path: str | Path) -> Path:
    """``path``, or where the default workload stands in for it: the contest reads ``./alpaca_5010.json``, so when
    that file is asked for and missing, the default workload (``workload``, seed 0) is used from the cache
    (``$LLM_SERVING_CACHE_DIR/workloads``), written there on first use: never into the source tree."""
    path = Path(path)
    if path != Path(DEFAULT_DATASET) or path.exists():
        return path
    from llm_serving.bench.workload import make_workload, write_workload

    # llm-serving's cache root (llm_serving.protocol.paths), read here as this package imports none of it
    root = os.environ.get("LLM_SERVING_CACHE_DIR") or Path.home() / ".cache" / "llm-serving"
    cached = Path(root) / "workloads" / path.name
    if not cached.exists():
        write_workload(make_workload(), cached)
        print(f"{path} not found: wrote the default workload to {cached} (scripts/make_workload.py makes others)",
              file=sys.stderr)
    return cached


def load_dataset(path: str | Path) -> list[dict[str, str]]:
    """Read an alpaca json list of ``{"instruction", "input", "output"}`` (strings), checking every record."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"dataset {path} not found (make one with scripts/make_workload.py)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BenchError(f"cannot read dataset {path}: {e}") from e
    if not isinstance(data, list) or not data:
        raise BenchError(f"dataset {path} must be a non-empty json list of alpaca records")
    for i, rec in enumerate(data):
        if not isinstance(rec, dict):
            raise BenchError(f"dataset {path} record {i} is {type(rec).__name__}, expected an object")
        for key in ("instruction", "input", "output"):
            if not isinstance(rec.get(key), str):
                raise BenchError(f"dataset {path} record {i}: key {key!r} missing or not a string")
    return data


def contest_prompt(record: dict[str, str]) -> str:
    return record["instruction"] + ":" + record["input"] if record["input"] else record["instruction"]
