"""Start-up time: process start -> /health ready of ``llm-serving serve``, for the default and the tuned configs,
without the compile cache, with a cold one and with a warm one (agents/runtime/compile_cache.py).

    python scripts/bench_startup.py [--runs 3] [--configs default,tuned] [--kernels] [--work-dir DIR]

default: configs/default.yaml (the embedded model, built before the runs). tuned: the config scripts/benchmark.py
serves its tuned row with (bench model, prefill batches <= 8, decode batches <= 128, seq buckets 32..512,
longest_output_first), written by its own ``write_config``. Each round runs, per config: ``off``
(serving_config.compile_cache: false, every shape compiled and run twice as before), ``cold`` (an empty cache
directory: compile, run, save) and ``warm`` (the directory ``cold`` just filled: load, no runs). ``--kernels``
adds one ``cold+kernels`` run per config in the first round with an empty native-kernel directory
($LLM_SERVING_KERNEL_DIR), so the g++ builds are counted too. The time is measured by this script from the
``Popen`` of the server to the first 200 from /health (polled every 50 ms); the phases come from the arrival
times of the server's progress lines. Other jobs share the machine: each run's 1-minute load average is shown.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from llm_serving.bench.local_server import free_port, stop

MODES = ("off", "cold", "warm")


@dataclass
class Run:
    config: str
    mode: str
    ready_s: float
    load: float
    phases: dict[str, float] = field(default_factory=dict)
    graphs: int = 0


def prepare(work: Path) -> dict[str, Path]:
    """The two base configs (the embedded model and the bench model built first, so no run includes a build)."""
    from llm_serving.config.serving_config import ServingConfig
    from llm_serving.models.default_model import ensure_default_model

    default = ROOT / "configs" / "default.yaml"
    cfg = ServingConfig.from_yaml(default)
    ensure_default_model(cfg.default_model, cfg.max_model_len)
    if not (work / "model" / "config.json").is_file():  # benchmark.py's own build, in its child process
        subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--prepare", "--work-dir", str(work)],
                       check=True, cwd=ROOT)
    from benchmark import TUNED, write_config

    tuned = write_config(work / "tuned.yaml", work / "model", TUNED["prefill"], TUNED["decode"],
                         "longest_output_first", 64)
    return {"default": default, "tuned": tuned}


def with_cache(base: Path, out: Path, cache: str | bool) -> Path:
    """``base`` with serving_config.compile_cache set (JSON is YAML; relative paths resolved against base)."""
    import yaml

    body = yaml.safe_load(base.read_text()) or {}
    if body.get("model_config", {}).get("model_path"):
        body["model_config"]["model_path"] = str((base.parent / body["model_config"]["model_path"]).resolve())
    body.setdefault("serving_config", {})["compile_cache"] = cache
    out.write_text(json.dumps(body, indent=1) + "\n")
    return out


def phases(lines: list[tuple[float, str]], ready: float) -> tuple[dict[str, float], int]:
    """Seconds per phase from the progress lines' arrival times: master up to listening, agent process start
    (interpreter, imports) to its first line, weights + MindSpore import, model build, warm-up, the rest."""
    def first(text: str) -> float | None:
        return next((t for t, line in lines if text in line), None)

    listen, loading, building = first("listening on"), first("loading weights"), first("building model")
    warmed = [(t, line) for t, line in lines if "warmed " in line]
    out: dict[str, float] = {}
    if listen is not None:
        out["master"] = listen
    if listen is not None and loading is not None:
        out["agent start"] = loading - listen
    if loading is not None and building is not None:
        out["weights+import"] = building - loading
    if warmed and building is not None:
        first_t, first_line = warmed[0]
        start = first_t - float(first_line.rsplit(" in ", 1)[1].rstrip("s"))
        out["model build"] = start - building
        out["warm-up"] = warmed[-1][0] - start
        out["after"] = ready - warmed[-1][0]
    return out, len(warmed)


def run_once(name: str, config: Path, mode: str, log_dir: Path, env: dict[str, str], timeout: float) -> Run:
    port = free_port()
    cmd = [sys.executable, "-m", "llm_serving", "serve", "--config", str(config), "--port", str(port)]
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready = None
    try:
        while time.perf_counter() - t0 < timeout and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        ready = time.perf_counter() - t0
                        break
            except OSError:
                pass
            time.sleep(0.05)
    finally:
        load = os.getloadavg()[0]
        stop(proc)
        reader.join(5)
        (log_dir / f"{name}_{mode}_{int(time.time())}.log").write_text(
            "".join(f"{t:8.2f} {line}\n" for t, line in lines))
    if ready is None:
        tail = "\n".join(line for _, line in lines[-20:])
        raise SystemExit(f"[bench_startup] {name} {mode}: not ready (exit {proc.returncode}); log tail:\n{tail}")
    found, graphs = phases(lines, ready)
    return Run(name, mode, ready, load, found, graphs)


def fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def table(runs: list[Run]) -> str:
    keys = ("master", "agent start", "weights+import", "model build", "warm-up", "after")
    rows = ["| config | compile cache | runs | process start -> ready, s: median (min-max) | graphs | "
            + " | ".join(keys) + " | load avg (1 min) |",
            "|---|---|---|---|---|" + "---|" * len(keys) + "---|"]
    order = [(c, m) for c in dict.fromkeys(r.config for r in runs) for m in (*MODES, "cold+kernels")]
    for config, mode in order:
        group = [r for r in runs if (r.config, r.mode) == (config, mode)]
        if not group:
            continue
        cells = [fmt([r.phases[k] for r in group if k in r.phases]) if any(k in r.phases for r in group) else "-"
                 for k in keys]
        rows.append(f"| {config} | {mode} | {len(group)} | {fmt([r.ready_s for r in group])} | {group[0].graphs} | "
                    + " | ".join(cells) + f" | {fmt([r.load for r in group])} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="rounds of off / cold / warm per config (default 3)")
    p.add_argument("--configs", default="default,tuned", help="comma-separated: default, tuned")
    p.add_argument("--kernels", action="store_true", help="also one run per config with the native kernels built")
    p.add_argument("--work-dir", default="/tmp/llm-serving-startup", help="bench model, configs, caches, logs")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for one start")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    bases = prepare(work)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = set(names) - set(bases)
    if unknown:
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {sorted(bases)}")
    runs: list[Run] = []
    print(f"[bench_startup] {os.cpu_count()} CPUs, load average {os.getloadavg()}", flush=True)
    for rnd in range(args.runs):
        for name in names:
            cache = Path(tempfile.mkdtemp(prefix=f"cc-{name}-", dir=work))
            plan = [("off", False, {}), ("cold", str(cache), {}), ("warm", str(cache), {})]
            if args.kernels and rnd == 0:
                kernels = Path(tempfile.mkdtemp(prefix="kernels-", dir=work))
                plan.append(("cold+kernels", str(Path(tempfile.mkdtemp(prefix=f"cc-{name}-", dir=work))),
                             {"LLM_SERVING_KERNEL_DIR": str(kernels)}))
            for mode, value, extra in plan:
                config = with_cache(bases[name], work / f"{name}_{mode}.yaml", value)
                run = run_once(name, config, mode, work / "logs", {**os.environ, **extra}, args.timeout)
                runs.append(run)
                print(f"[bench_startup] round {rnd + 1} {name} {mode}: ready in {run.ready_s:.1f}s, {run.graphs} "
                      f"graphs, load {run.load:.2f}, "
                      f"phases {json.dumps({k: round(v, 2) for k, v in run.phases.items()})}",
                      flush=True)
            for path in work.glob(f"cc-{name}-*"):
                shutil.rmtree(path, ignore_errors=True)
            for path in work.glob("kernels-*"):
                shutil.rmtree(path, ignore_errors=True)
    print()
    print(f"python scripts/bench_startup.py {' '.join(argv if argv is not None else sys.argv[1:])}".strip())
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
