"""The one-way boundary between the master and the agents, checked on every import statement in the source
(module level and inside functions) and by importing the whole master in a fresh interpreter.

- agents import only ``llm_serving.protocol`` from the master's package;
- the master (``llm_serving``) never imports MindSpore nor any ``agents`` module;
- the protocol imports nothing else from ``llm_serving``;
- the load-test tool stands alone: it talks HTTP to a server and imports neither side.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in ``source``, a module of ``package``;
    relative imports resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def violations(package: str, allowed) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        package_of_path = ".".join(path.relative_to(ROOT).parts[:-1])
        for line, name in imported_modules(path.read_text(), package_of_path):
            reason = allowed(path, name)
            if reason:
                out.append(f"{path.relative_to(ROOT)}:{line}: imports {name} ({reason})")
    return out


def _top(name: str) -> str:
    return name.split(".")[0]


def agents_rule(path: Path, name: str) -> str | None:
    if _top(name) == "llm_serving" and not (name == "llm_serving.protocol" or
                                            name.startswith("llm_serving.protocol.")):
        return "agents may import only llm_serving.protocol"
    return None


def master_rule(path: Path, name: str) -> str | None:
    if _top(name) == "mindspore":
        return "the master never imports MindSpore"
    if _top(name) == "agents":
        return "the master talks to agents through llm_serving.protocol only"
    in_protocol = "protocol" in path.relative_to(ROOT).parts
    if in_protocol and _top(name) == "llm_serving" and not name.startswith("llm_serving.protocol"):
        return "the protocol depends on nothing else in llm_serving"
    return None


def loadtest_rule(path: Path, name: str) -> str | None:
    if _top(name) in ("llm_serving", "agents", "mindspore"):
        return "the load-test tool talks HTTP only"
    return None


@pytest.mark.parametrize(("package", "rule"), [("agents", agents_rule), ("llm_serving", master_rule),
                                               ("loadtest", loadtest_rule)])
def test_the_boundary_holds_in_every_import_statement(package, rule):
    assert violations(package, rule) == []


def test_the_rules_catch_what_they_forbid():
    assert agents_rule(ROOT / "agents/x.py", "llm_serving.core.scheduler")
    assert not agents_rule(ROOT / "agents/x.py", "llm_serving.protocol.batch")
    assert master_rule(ROOT / "llm_serving/x.py", "mindspore.ops")
    assert master_rule(ROOT / "llm_serving/x.py", "agents.weights.checkpoints")
    assert master_rule(ROOT / "llm_serving/protocol/x.py", "llm_serving.config.serving_config")
    assert not master_rule(ROOT / "llm_serving/protocol/x.py", "llm_serving.protocol.batch")
    assert loadtest_rule(ROOT / "loadtest/x.py", "llm_serving.tokenization.tokenizer")
    # a function-level import counts too, and relative imports are resolved
    source = "def f():\n    import mindspore\n    from .protocol import wire\n    from ..agents import x\n"
    assert imported_modules(source, "llm_serving.sub") == [
        (2, "mindspore"), (3, "llm_serving.sub.protocol"), (4, "llm_serving.agents")]


def test_importing_every_master_module_loads_no_mindspore():
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for p in (ROOT / "llm_serving").rglob("*.py") if p.name != "__main__.py")
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mindspore', 'agents'))\n"
            "print(len(bad), bad[:5])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "0", out.stdout
