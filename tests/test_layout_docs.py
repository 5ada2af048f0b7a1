"""The package trees in README.md ("Layout") and docs/architecture.md ("Packages") match the source tree: every
sub-package of the master and the agents is listed under its side, and nothing listed is missing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("llm_serving", "agents")


def listed_tree(doc: Path, heading: str) -> dict[str, set[str]]:
    """The first code block under ``heading``: each side's indented entries (``name/`` or ``name.py``)."""
    text = doc.read_text()
    block = text[text.index(heading):].split("```")[1]
    tree: dict[str, set[str]] = {}
    side = None
    for line in block.splitlines():
        top = re.match(r"(\w+)/\s", line + " ")
        if top:
            side = top.group(1) if top.group(1) in SIDES else None
            if side:
                tree[side] = set()
            continue
        child = re.match(r"  (\w+)(/|\.py)\s", line + " ")
        if side and child:
            tree[side].add(child.group(1) + child.group(2))
    return tree


def source_tree(with_modules: bool) -> dict[str, set[str]]:
    tree = {}
    for side in SIDES:
        names = {p.name + "/" for p in (ROOT / side).iterdir() if (p / "__init__.py").is_file()}
        if with_modules:
            names |= {p.name for p in (ROOT / side).glob("*.py") if not p.name.startswith("__")}
        tree[side] = names
    return tree


@pytest.mark.parametrize(("doc", "heading", "with_modules"), [("README.md", "## Layout", False),
                                                              ("docs/architecture.md", "## Packages", True)])
def test_the_documented_tree_is_the_source_tree(doc, heading, with_modules):
    listed = listed_tree(ROOT / doc, heading)
    if not with_modules:
        listed = {side: {n for n in names if n.endswith("/")} for side, names in listed.items()}
    assert listed == source_tree(with_modules)


def test_a_missing_package_is_noticed(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("## Layout\n\n```\nllm_serving/   master\n  core/   x\nagents/   y\n  model/   z\n```\n")
    assert listed_tree(doc, "## Layout") == {"llm_serving": {"core/"}, "agents": {"model/"}}
    assert listed_tree(doc, "## Layout") != source_tree(False)
