"""The reliability suite: hostile and unlucky clients against a live server on this machine, as figures.

    python scripts/chaos.py --url http://127.0.0.1:8000 [--sections fuzz,soak] [--api-key KEY] [--json OUT]

Sections (each prints one table of figures; ``--json`` writes them all):
- ``fuzz``: generated hostile requests across every route (``chaos_fuzz``): status classes, 5xx count,
  errors that are not JSON, hangs; the server's health and KV blocks in use afterwards.
- ``soak``: a bounded mixed load (``chaos_soak``): sent, ok, clean refusals, errors, hangs, KV blocks in use
  after.
- whatever ``scripts/chaos_agents.py`` defines (agent SIGKILL/SIGSTOP recovery, a poisoned request's blast
  radius), when that module exists: its ``SECTIONS`` list is appended. The interface is in ``chaos_core``.

Only loopback servers are accepted. The exit status is 0 when every section ran and none reported
``passed: false``, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the chaos_* modules beside this file

import chaos_fuzz
import chaos_soak
from chaos_core import Context, Section, SectionError


def load_sections() -> list[Section]:
    """The built-in sections, then ``chaos_agents.SECTIONS`` if that module exists."""
    sections = [chaos_fuzz.SECTION, chaos_soak.SECTION]
    try:
        import chaos_agents
    except ModuleNotFoundError as exc:
        if exc.name != "chaos_agents":
            raise  # the module exists but one of its imports is missing: say so
        return sections
    return sections + list(chaos_agents.SECTIONS)


def build_parser(sections: list[Section]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chaos.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (loopback only)")
    p.add_argument("--api-key", help="the server's API key, if it needs one")
    p.add_argument("--sections", default=",".join(s.name for s in sections[:2]),
                   help=f"comma-separated, run in this order; known: {', '.join(s.name for s in sections)} "
                        "(default: fuzz,soak)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    for s in sections:
        if s.add_arguments is not None:
            s.add_arguments(p)
    return p


def parse_args(argv: list[str] | None = None, sections: list[Section] | None = None) -> argparse.Namespace:
    return build_parser(sections or load_sections()).parse_args(argv)


async def run_sections(ctx: Context, chosen: list[Section]) -> dict[str, dict[str, Any]]:
    """Each section's figures (or its error, as ``{"error": ..., "passed": False}``), in order."""
    out: dict[str, dict[str, Any]] = {}
    for section in chosen:
        t0 = time.monotonic()
        ctx.log(f"== {section.name}: {section.help}")
        try:
            out[section.name] = await section.run(ctx)
        except SectionError as exc:
            out[section.name] = {"error": str(exc), "passed": False}
        except Exception as exc:  # noqa: BLE001 - one section's failure is its figure; the others still run
            out[section.name] = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
        ctx.log(f"== {section.name} done in {time.monotonic() - t0:.1f}s")
    return out


def table(name: str, figures: dict[str, Any]) -> str:
    rows = [f"### {name}", "", "| figure | value |", "|---|---|"]
    rows += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in figures.items()]
    return "\n".join(rows)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    sections = load_sections()
    args = parse_args(argv, sections)
    by_name = {s.name: s for s in sections}
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        print(f"error: unknown section(s) {', '.join(unknown)}; known: {', '.join(by_name)}", file=sys.stderr)
        return 2
    try:
        ctx = Context(args.url, args, api_key=args.api_key, log=_log)
    except SectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    figures = asyncio.run(run_sections(ctx, [by_name[n] for n in names]))
    print("\n\n".join(table(name, f) for name, f in figures.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if all(f.get("passed", True) for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
