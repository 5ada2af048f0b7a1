"""Our MindFormers patches (patches/) and the command that applies them (llm_serving/cli/commands/patch_mindformers.py),
checked against the real pinned release: the MindFormers 1.8.0 wheel from PyPI (downloaded once into
the cache root's wheels/, no dependencies, nothing imported), unpacked into a temporary directory that stands
for site-packages.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from llm_serving.cli.commands.patch_mindformers import (
    PATCH_ROOT,
    PINNED_VERSION,
    PatchError,
    apply_patches,
    default_target,
    patches_for,
    read_patch,
)
from llm_serving.protocol.paths import cache_root

ROOT = Path(__file__).resolve().parents[1]
WHEEL_CACHE = cache_root() / "wheels"
LLAMA = "mindformers/models/llama/llama.py"


@pytest.fixture(scope="module")
def wheel() -> Path:
    """The pinned MindFormers wheel (pip download, cached)."""
    found = sorted(WHEEL_CACHE.glob(f"mindformers-{PINNED_VERSION}-*.whl"))
    if not found:
        out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(WHEEL_CACHE),
                              f"mindformers=={PINNED_VERSION}"], capture_output=True, text=True, check=False)
        found = sorted(WHEEL_CACHE.glob(f"mindformers-{PINNED_VERSION}-*.whl"))
        if not found:
            # not a skip: the patches' proof needs the release (the suite's MindFormers env needs PyPI too)
            pytest.fail(f"cannot download mindformers=={PINNED_VERSION} from PyPI: {out.stderr.strip()[-300:]}")
    return found[0]


@pytest.fixture
def release(wheel: Path, tmp_path: Path) -> Path:
    """The release unpacked as site-packages would hold it (package + dist-info)."""
    target = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    return target


def digest(target: Path) -> dict[str, str]:
    return {str(p.relative_to(target)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted((target / "mindformers").rglob("*")) if p.is_file()}


# ---- the patch files ---------------------------------------------------------------------------------------
def test_every_patch_has_a_checked_header() -> None:
    files = sorted(PATCH_ROOT.glob("mindformers-*/*.patch"))
    assert files, "no patches"
    for path in files:
        info = read_patch(path)
        assert info.version == PINNED_VERSION
        assert len(info.what) > 40 and len(info.why) > 40, path
        assert info.files == info.diff_files
    assert [p.path.name for p in patches_for(PINNED_VERSION)] == [p.name for p in files]


def header_variant(tmp_path: Path, old: str, new: str, folder: str = f"mindformers-{PINNED_VERSION}") -> Path:
    src = min(PATCH_ROOT.glob(f"mindformers-{PINNED_VERSION}/*.patch"))
    text = src.read_text()
    assert old in text
    out = tmp_path / folder / src.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.replace(old, new, 1))
    return out


def test_header_mistakes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PatchError, match="header lacks Why"):
        read_patch(header_variant(tmp_path / "a", "\nWhy: ", "\nBecause: "))
    with pytest.raises(PatchError, match="header Files .* but the diff changes"):
        read_patch(header_variant(tmp_path / "b", f"Files: {LLAMA}", "Files: mindformers/other.py"))
    with pytest.raises(PatchError, match="header says MindFormers 1.8.0, its folder mindformers-1.9.0"):
        read_patch(header_variant(tmp_path / "c", "x", "x", folder="mindformers-1.9.0"))


# ---- against the real release ------------------------------------------------------------------------------
def test_patches_apply_cleanly_to_the_pinned_release(release: Path) -> None:
    before = digest(release)
    assert [state for _, state in apply_patches(release, check=True)] == ["applies"] * len(patches_for(PINNED_VERSION))
    assert digest(release) == before  # a check changes nothing
    assert {state for _, state in apply_patches(release)} == {"patched"}
    changed = {name for name, h in digest(release).items() if before.get(name) != h}
    assert changed == {f for info in patches_for(PINNED_VERSION) for f in info.files}
    source = (release / LLAMA).read_text()
    assert "P.ArgMaxWithValue(axis=-1)" in source and "def greedy_pick(self, logits):" in source
    assert not list(release.rglob("*.orig")) and not list(release.rglob("*.rej"))
    # idempotent: a second run finds them applied and changes nothing
    after = digest(release)
    assert {state for _, state in apply_patches(release)} == {"applied"}
    assert {state for _, state in apply_patches(release, check=True)} == {"applied"}
    assert digest(release) == after


def test_other_version_is_refused(release: Path) -> None:
    metadata = next(release.glob("mindformers-*.dist-info")) / "METADATA"
    metadata.write_text(re.sub(r"^Version: .*$", "Version: 1.9.0", metadata.read_text(), count=1, flags=re.MULTILINE))
    before = digest(release)
    with pytest.raises(PatchError, match=r"MindFormers 1\.9\.0 is installed, but llm-serving's patches are for "
                                         r"MindFormers 1\.8\.0: install mindformers==1\.8\.0 \(`bash "
                                         r"scripts/mindformers_env\.sh` creates that environment\)"):
        apply_patches(release)
    assert digest(release) == before


def test_changed_file_is_refused_and_left_alone(release: Path) -> None:
    llama = release / LLAMA
    llama.write_text(llama.read_text().replace("                logits = self.reshape(logits, (-1, logits.shape[-1]))\n"
                                               "                return logits\n",
                                               "                return logits\n", 1))
    before = digest(release)
    with pytest.raises(PatchError, match="0001-llama-greedy-in-graph.patch does not apply cleanly"):
        apply_patches(release)
    assert digest(release) == before


def test_no_patch_is_applied_when_a_later_one_conflicts(release: Path, tmp_path: Path) -> None:
    """Every patch is dry-run before any is applied: a conflicting second patch leaves the first unapplied."""
    root = tmp_path / "patches"
    folder = root / f"mindformers-{PINNED_VERSION}"
    shutil.copytree(PATCH_ROOT / folder.name, folder)
    good = min(folder.glob("*.patch")).read_text()
    (folder / "0099-conflict.patch").write_text(good.replace("         self.sub_batch_valid_len = P.Sub()",
                                                            "         self.sub_batch_valid_len = P.Add()", 1))
    before = digest(release)
    with pytest.raises(PatchError, match="0099-conflict.patch does not apply cleanly"):
        apply_patches(release, root=root)
    assert digest(release) == before


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llm_serving", "patch-mindformers", *args], cwd=ROOT,
                          capture_output=True, text=True, check=False)


def test_command_checks_then_applies(release: Path) -> None:
    out = run_cli("--check", "--target", str(release))
    assert out.returncode == 0, out.stderr
    assert "applies  mindformers-1.8.0/0001-llama-greedy-in-graph.patch" in out.stdout
    assert "every patch applies or is applied (dry run)" in out.stdout
    out = run_cli("--target", str(release))
    assert out.returncode == 0 and "patched  mindformers-1.8.0/0001" in out.stdout


def test_command_without_mindformers_says_how_to_get_it() -> None:
    try:
        default_target()
    except PatchError as exc:
        assert "bash scripts/mindformers_env.sh" in str(exc)
    else:
        pytest.skip("MindFormers is installed in this environment")
    out = run_cli("--check")
    assert out.returncode == 1
    assert "MindFormers is not installed" in out.stderr and "scripts/mindformers_env.sh" in out.stderr
