"""Apply our versioned patches (``patches/mindformers-<version>/*.patch``) to an installed MindFormers.

    llm-serving patch-mindformers [--check] [--target SITE_PACKAGES]
    python -m llm_serving.cli.commands.patch_mindformers [--check] [--target SITE_PACKAGES]

Plain file patching with the ``patch`` tool: MindFormers (and MindSpore) are never imported, so this runs in the
master's environment too, against any directory that holds a ``mindformers/`` package (a venv's site-packages or
an unpacked wheel). Order of checks: the installed version must be one we have patches for; every patch is
dry-run first (``--fuzz=0``: clean or nothing); only when all of them apply (or are already applied) are they
applied, so a failure never leaves MindFormers half patched. ``--check`` stops after the dry run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from llm_serving.cli.options import Command

PATCH_ROOT = Path(__file__).resolve().parents[3] / "patches"
PINNED_VERSION = "1.8.0"  # the MindFormers release scripts/mindformers_env.sh installs
ENV_COMMAND = "bash scripts/mindformers_env.sh"
_HEADER_KEYS = ("Subject", "MindFormers-Version", "Files")


class PatchError(RuntimeError):
    """Patches that cannot be applied here; the message says why and what to do."""


@dataclass(frozen=True)
class PatchInfo:
    """One patch file: its header (what, why, the release and files it is for) and the files its diff touches."""

    path: Path
    subject: str
    version: str
    files: tuple[str, ...]
    what: str
    why: str
    diff_files: tuple[str, ...]


def read_patch(path: Path) -> PatchInfo:
    """Parse and check a patch file's header: every key present, What/Why paragraphs, ``Files`` equal to the
    files its diff touches, ``MindFormers-Version`` equal to its directory's version."""
    text = path.read_text(encoding="utf-8")
    head, sep, diff = text.partition("\n---\n")
    if not sep:
        raise PatchError(f"{path}: no '---' line between the header and the diff")
    fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", head, re.MULTILINE))
    missing = [k for k in _HEADER_KEYS + ("What", "Why") if k not in fields]
    if missing:
        raise PatchError(f"{path}: header lacks {', '.join(missing)}")
    paragraphs = {}
    for k in ("What", "Why"):  # each up to a blank line
        found = re.search(rf"^{k}: (.*?)(?:\n\n|\Z)", head, re.DOTALL | re.MULTILINE)
        if found is None:  # not reached: the header has the key (checked above)
            raise PatchError(f"{path}: header lacks {k}")
        paragraphs[k] = found.group(1).strip()
    diff_files = tuple(m.split("/", 1)[1] for m in re.findall(r"^\+\+\+ (\S+)", diff, re.MULTILINE))
    info = PatchInfo(path, fields["Subject"], fields["MindFormers-Version"],
                     tuple(f.strip() for f in fields["Files"].split(",")), paragraphs["What"], paragraphs["Why"],
                     diff_files)
    if not diff_files:
        raise PatchError(f"{path}: no diff after the header")
    if set(info.files) != set(diff_files):
        raise PatchError(f"{path}: header Files {list(info.files)} but the diff changes {list(diff_files)}")
    folder_version = path.parent.name.removeprefix("mindformers-")
    if info.version != folder_version:
        raise PatchError(f"{path}: header says MindFormers {info.version}, its folder {path.parent.name}")
    return info


def patches_for(version: str, root: Path = PATCH_ROOT) -> list[PatchInfo]:
    """The patches for MindFormers ``version``, in order; a clear error when there are none."""
    folder = root / f"mindformers-{version}"
    files = sorted(folder.glob("*.patch"))
    if not files:
        have = sorted(p.name.removeprefix("mindformers-") for p in root.glob("mindformers-*") if p.is_dir())
        raise PatchError(f"MindFormers {version} is installed, but llm-serving's patches are for MindFormers "
                         f"{', '.join(have) or '(none found in ' + str(root) + ')'}: install "
                         f"mindformers=={PINNED_VERSION} (`{ENV_COMMAND}` creates that environment)")
    return [read_patch(p) for p in files]


def default_target() -> Path:
    """The directory holding the importable ``mindformers`` package (found without importing it)."""
    spec = importlib.util.find_spec("mindformers")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(f"MindFormers is not installed in {sys.executable}'s environment: run this with the "
                         f"MindFormers environment's python, pass --target SITE_PACKAGES, or create it with "
                         f"`{ENV_COMMAND}`")
    return Path(next(iter(spec.submodule_search_locations))).parent


def installed_version(target: Path) -> str:
    """MindFormers' version in ``target``: its dist-info metadata, else ``mindformers/__init__.py``."""
    if not (target / "mindformers").is_dir():
        raise PatchError(f"{target} holds no mindformers package")
    for dist in importlib.metadata.distributions(path=[str(target)]):
        if (dist.metadata["Name"] or "").lower() == "mindformers":
            return dist.version
    init = (target / "mindformers" / "__init__.py").read_text(encoding="utf-8", errors="replace")
    found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", init, re.MULTILINE)
    if not found:
        raise PatchError(f"cannot tell the MindFormers version in {target} (no dist-info, no __version__)")
    return found.group(1)


def _patch_tool(target: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    tool = shutil.which("patch")
    if tool is None:
        raise PatchError("the `patch` program is not installed (Debian/Ubuntu: apt-get install patch)")
    return subprocess.run([tool, "-p1", "--batch", "--fuzz=0", "--no-backup-if-mismatch", "-d", str(target),
                           "-i", str(patch), *flags], capture_output=True, text=True, check=False)


def patch_state(target: Path, info: PatchInfo) -> str:
    """"applied", "applies" (cleanly) or raises ``PatchError`` with the tool's output."""
    if _patch_tool(target, info.path, "--dry-run", "--forward").returncode == 0:
        return "applies"
    if _patch_tool(target, info.path, "--dry-run", "--reverse").returncode == 0:
        return "applied"
    out = _patch_tool(target, info.path, "--dry-run", "--forward")
    raise PatchError(f"{info.path.name} does not apply cleanly to MindFormers in {target} (were its files "
                     f"changed by hand?):\n{(out.stdout + out.stderr).strip()}")


def apply_patches(target: Path, check: bool = False, root: Path = PATCH_ROOT) -> list[tuple[PatchInfo, str]]:
    """Check the version, dry-run every patch, then (unless ``check``) apply those not yet applied. Returns each
    patch with its state: "applied" (before), "patched" (now), "applies" (``check``)."""
    version = installed_version(target)
    infos = patches_for(version, root)
    states = [(info, patch_state(target, info)) for info in infos]  # all dry runs before any change
    if check:
        return states
    done = []
    for info, state in states:
        if state == "applies":
            out = _patch_tool(target, info.path, "--forward")
            if out.returncode != 0:
                raise PatchError(f"{info.path.name} failed after a clean dry run:\n{(out.stdout + out.stderr).strip()}")
            state = "patched"
        done.append((info, state))
    return done


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true", help="only check the version and dry-run the patches")
    p.add_argument("--target", type=Path, metavar="DIR", help="directory holding the mindformers package "
                   "(default: where this python finds it, without importing it)")


def run(args: argparse.Namespace) -> int:
    try:
        target = args.target.resolve() if args.target else default_target()
        results = apply_patches(target, check=args.check)
    except PatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for info, state in results:
        print(f"{state:8} {info.path.parent.name}/{info.path.name}: {info.subject}")
    print(f"MindFormers {installed_version(target)} in {target}: "
          + ("every patch applies or is applied (dry run)" if args.check else "patched"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llm_serving.cli.commands.patch_mindformers",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


COMMAND = Command("patch-mindformers", "apply llm-serving's patches (patches/) to the installed MindFormers: "
                  "version check and dry run first (--check: only those)", add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
