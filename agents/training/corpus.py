"""The training text: the Python standard library's docstrings and its reference topics (``pydoc_data``).

Every machine with Python has it, so training needs no download. The order is fixed (sorted paths, then source
order) and a module goes wholly to training or to the held-out set by a hash of its path, so the same Python
gives the same split on every machine. Never imports MindSpore.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MIN_DOC_CHARS = 40  # one-line docstrings ("Return self.") teach little and dominate by count
HELD_OUT_EVERY = 20  # one module in 20 (by path hash) is held out
# Test suites are mostly assertions; their docstrings are few and odd.
_SKIPPED_PARTS = ("test", "tests", "idle_test", "site-packages")


@dataclass(frozen=True)
class Corpus:
    train: list[str]
    held_out: list[str]
    source: str  # where the text came from, for the training report

    @property
    def chars(self) -> tuple[int, int]:
        return sum(map(len, self.train)), sum(map(len, self.held_out))


def _held_out(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []  # a few stdlib files are deliberately invalid (lib2to3 fixtures, bad encodings)
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(node, clean=True) for node in ast.walk(tree) if isinstance(node, kinds))
    return [d for d in docs if d and len(d) >= MIN_DOC_CHARS]


def _topics() -> list[tuple[str, str]]:
    """The language reference sections ``help()`` shows, one document each."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return []
    return [(f"pydoc_data/{name}", topics[name].strip()) for name in sorted(topics)]


def stdlib_corpus(stdlib: Path | None = None) -> Corpus:
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    documents: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _SKIPPED_PARTS for part in rel.parts[:-1]):
            continue
        documents += [(rel.as_posix(), doc) for doc in _docstrings(path)]
    documents += _topics()
    train = [doc for name, doc in documents if not _held_out(name)]
    held = [doc for name, doc in documents if _held_out(name)]
    if not train or not held:
        raise RuntimeError(f"no usable standard-library text under {root}")
    return Corpus(train=train, held_out=held, source=str(root))
