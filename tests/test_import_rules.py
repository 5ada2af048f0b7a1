"""The layering of the code, checked on every import statement in the source (module level, inside functions
and under ``TYPE_CHECKING`` alike) and by importing the whole master in a fresh interpreter.

- agents import only ``llm_serving.protocol`` from the master's package;
- the master (``llm_serving``) never imports MindSpore nor any ``agents`` module;
- the protocol imports nothing else from ``llm_serving``;
- the load-test client (``loadtest``) talks HTTP to a server: of the master it imports only ``llm_serving.bench``
  (a load test's workloads, results and metrics, which the simulator shares; it imports nothing else of
  ``llm_serving``), nothing of the agents; the dependency is one-way: the master never imports ``loadtest``,
  but for its command line's ``bench`` (which offers the client as ``llm-serving bench``);
- inside each side, a sub-package imports only the sub-packages its ``LAYERS`` entry names (the same list its
  ``__init__`` docstring states), and no module imports itself back through others (no import circles).
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


def violations(package: str, allowed, root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted((root / package).rglob("*.py")):
        package_of_path = ".".join(path.relative_to(root).parts[:-1])
        for line, name in imported_modules(path.read_text(), package_of_path):
            reason = allowed(path.relative_to(root), name)
            if reason:
                out.append(f"{path.relative_to(root)}:{line}: imports {name} ({reason})")
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
    in_protocol = "protocol" in path.parts
    if in_protocol and _top(name) == "llm_serving" and not name.startswith("llm_serving.protocol"):
        return "the protocol depends on nothing else in llm_serving"
    if _top(name) == "loadtest" and layer_of(path) != "cli":
        return "the master never imports the load-test client (what both use is llm_serving.bench)"
    return None


# Each side's sub-packages (and top-level modules, by name without .py) and the sub-packages of the same side
# they may import; anything not listed here may import nothing of its side. "*": any.
LAYERS = {
    "llm_serving": {
        "protocol": set(),
        "describe": set(),
        "request_errors": set(),  # every exception that describes a bad or refused request
        "bench": set(),  # shared with the load-test client, which may import it and nothing else of the master
        "core": {"protocol", "request_errors"},
        "config": {"protocol", "core"},
        "tokenization": {"config", "describe", "request_errors", "bench"},
        "models": {"protocol", "config", "tokenization"},
        "executor": {"protocol"},
        "engine": {"protocol", "core", "config", "tokenization", "models", "executor", "request_errors"},
        "front": {"request_errors"},  # the HTTP guards and JSON errors the engine's server and the router share
        "api": {"protocol", "core", "config", "tokenization", "engine", "executor", "describe", "request_errors",
                "front"},
        "simulator": {"protocol", "core", "config", "tokenization", "models", "engine", "bench"},
        "router": {"front", "request_errors"},
        "cli": {"*"},
        "__init__": {"engine"},  # the lazy ``llm_serving.LLM``
        "__main__": {"cli"},
    },
    "agents": {
        "weights": set(),
        "model": {"weights"},
        "runtime": {"weights", "model"},
        "tools": {"weights", "model", "runtime"},
        "mindformers": {"weights", "runtime", "tools"},
        "training": {"weights", "model"},
        "agent_main": {"*"},
        "__init__": set(),
    },
}


def layer_of(path: Path) -> str:
    """The sub-package (or top-level module) of a source file: ``llm_serving/core/x.py`` -> ``core``."""
    parts = path.parts[1:]
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def layer_rule(path: Path, name: str) -> str | None:
    side, mine = path.parts[0], layer_of(path)
    if _top(name) != side or name.count(".") == 0:
        return None
    theirs = name.split(".")[1]
    allowed = LAYERS[side].get(mine, set())
    if theirs == mine or "*" in allowed or theirs in allowed:
        return None
    return f"{side}.{mine} may import only {sorted(allowed) or 'nothing'} of {side}"


def import_graph(packages: tuple[str, ...] = ("llm_serving", "agents"), root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (``from p import m`` is an edge to module p.m when m is
    one). A package's own ``__init__`` imported only because a submodule is imported is not an edge."""
    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = imported_modules(ast.unparse(node), package)[0][1]
                subs = {f"{base}.{a.name}" for a in node.names} & files.keys()
                edges |= subs or ({base} & files.keys())
        graph[module] = edges - {module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan): each is an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def loadtest_rule(path: Path, name: str) -> str | None:
    if _top(name) in ("agents", "mindspore"):
        return "the load-test client talks HTTP only"
    if _top(name) == "llm_serving" and not (name == "llm_serving.bench" or name.startswith("llm_serving.bench.")):
        return "the load-test client talks HTTP only: of the master it imports only llm_serving.bench"
    return None


@pytest.mark.parametrize(("package", "rule"), [("agents", agents_rule), ("llm_serving", master_rule),
                                               ("loadtest", loadtest_rule)])
def test_the_boundary_holds_in_every_import_statement(package, rule):
    assert violations(package, rule) == []


@pytest.mark.parametrize("package", ["llm_serving", "agents"])
def test_each_sub_package_imports_only_its_layers(package):
    assert violations(package, layer_rule) == []


def test_every_sub_package_is_a_layer_whose_docstring_names_what_it_may_import():
    for side, layers in LAYERS.items():
        found = {p.name for p in (ROOT / side).iterdir() if (p / "__init__.py").is_file()}
        found |= {p.stem for p in (ROOT / side).glob("*.py")}
        assert found == set(layers), f"{side}: add new sub-packages to LAYERS (and their docstring)"
        for layer, allowed in layers.items():
            init = ROOT / side / layer / "__init__.py"
            if init.is_file() and allowed and "*" not in allowed:
                doc = ast.get_docstring(ast.parse(init.read_text())) or ""
                assert "May import:" in doc, f"{init} does not say what it may import"
                for other in allowed:
                    assert other in doc, f"{init}: its docstring does not name {other}, which LAYERS allows"


def test_no_module_imports_itself_back():
    assert import_circles(import_graph(("llm_serving", "agents", "loadtest"))) == []


def test_the_rules_catch_what_they_forbid(tmp_path):
    assert agents_rule(Path("agents/x.py"), "llm_serving.core.scheduler")
    assert not agents_rule(Path("agents/x.py"), "llm_serving.protocol.batch")
    assert master_rule(Path("llm_serving/x.py"), "mindspore.ops")
    assert master_rule(Path("llm_serving/x.py"), "agents.weights.checkpoints")
    assert master_rule(Path("llm_serving/protocol/x.py"), "llm_serving.config.serving_config")
    assert not master_rule(Path("llm_serving/protocol/x.py"), "llm_serving.protocol.batch")
    assert loadtest_rule(Path("loadtest/x.py"), "llm_serving.tokenization.tokenizer")
    assert loadtest_rule(Path("loadtest/x.py"), "llm_serving")
    assert not loadtest_rule(Path("loadtest/x.py"), "llm_serving.bench.metrics")
    assert master_rule(Path("llm_serving/simulator/run.py"), "loadtest.client")
    assert not master_rule(Path("llm_serving/cli/commands/bench.py"), "loadtest.cli")
    # layers: the engine core must not reach up into the HTTP front end, nor the model into the runtime
    assert layer_rule(Path("llm_serving/core/scheduler.py"), "llm_serving.api.server")
    assert not layer_rule(Path("llm_serving/api/server.py"), "llm_serving.core.scheduler")
    assert layer_rule(Path("agents/model/llama.py"), "agents.runtime.runner")
    assert not layer_rule(Path("agents/runtime/runner.py"), "agents.model.llama")
    # a forbidden import added to a copy of the tree is found, and so is the circle it makes
    copy = tmp_path / "tree"
    for pkg in ("llm_serving", "agents"):
        for src in (ROOT / pkg).rglob("*.py"):
            dst = copy / src.relative_to(ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(src.read_text())
    scheduler = copy / "llm_serving/core/scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\n\ndef _late():\n    from llm_serving.api import server\n")
    assert violations("llm_serving", layer_rule, copy) == [
        (f"llm_serving/core/scheduler.py:{len(scheduler.read_text().splitlines())}: imports llm_serving.api "
         "(llm_serving.core may import only ['protocol', 'request_errors'] of llm_serving)")]
    circles = import_circles(import_graph(root=copy))
    assert any({"llm_serving.core.scheduler", "llm_serving.api.server"} <= set(c) for c in circles), circles
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
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
