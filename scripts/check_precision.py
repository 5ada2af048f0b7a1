"""Check dumped logits against a reference with the contest's precision rule (relative error within 5 per mille).

    python scripts/check_precision.py REF OURS [--tolerance 0.005]

REF and OURS are two ``.npy`` files, or two directories whose ``.npy`` files are paired by name (as
``llm-serving generate --dump-logits DIR`` writes them: ``DIR/<prompt index>.npy``, float32 ``[N, vocab]``, row k
the logits token k was picked from). Every file of REF must be in OURS with the same shape.

The rule, per generated position (one row ``b`` of the reference and the matching row ``a`` of ours)::

    error(row) = max_v |a[v] - b[v]| / max_v |b[v]|

and the check passes when ``error(row) <= tolerance`` (0.005) for every row of every file and ours holds only
finite values. Why this definition: an element-wise ``|a - b| / |b|`` is unbounded where a reference logit is
near zero, and a full vocabulary always has logits near zero, so no implementation could meet it; dividing by
the row's largest magnitude measures the error on the scale of the logits. Taking the max over the vocabulary
(not the mean) holds every entry to the bound, the top candidates that decide the greedy pick included. The mean
relative error ``sum|a - b| / sum|b|`` of the worst row is printed as well, for contest scripts that use it.

Exit status: 0 pass, 1 fail (an error over the tolerance, a missing file, a shape mismatch, NaN/inf), 2 for
unreadable inputs or bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TOLERANCE = 0.005  # 5 per mille


class InputError(Exception):
    """Inputs that cannot be compared at all (exit status 2)."""


@dataclass(frozen=True)
class Worst:
    """The row with the largest error: its file, position (row index) and both error measures."""

    name: str
    position: int
    error: float
    mean_error: float


def row_errors(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """``max_v |ours - ref| / max_v |ref|`` per row (float64); inf where ours is not finite or ref is all zero."""
    a, b = ours.astype(np.float64), ref.astype(np.float64)
    scale = np.abs(b).max(axis=-1)
    diff = np.abs(a - b).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.where(scale > 0, diff / scale, np.where(diff == 0, 0.0, np.inf))
    return np.where(np.isfinite(a).all(axis=-1), err, np.inf)


def mean_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """``sum |ours - ref| / sum |ref|`` of one row (the mean relative error some contest scripts use)."""
    a, b = ours.astype(np.float64), ref.astype(np.float64)
    total = np.abs(b).sum()
    return float(np.abs(a - b).sum() / total) if total > 0 else float("inf")


def pair_files(ref: Path, ours: Path) -> list[tuple[str, Path, Path]]:
    """(name, reference file, our file) pairs; our file may not exist (a failure reported by ``compare``)."""
    if ref.is_file() and (ours.is_file() or not ours.exists()):
        return [(ref.name, ref, ours)]
    if ref.is_dir() and ours.is_dir():
        files = sorted(ref.glob("*.npy"), key=lambda p: (len(p.stem), p.stem))  # 2.npy before 10.npy
        if not files:
            raise InputError(f"no .npy files in {ref}")
        return [(p.name, p, ours / p.name) for p in files]
    raise InputError(f"REF and OURS must be two .npy files or two directories, got {ref} and {ours}")


def _load(path: Path) -> np.ndarray:
    try:
        values = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from None
    if values.ndim != 2 or not np.issubdtype(values.dtype, np.floating):
        raise InputError(f"{path}: expected float logits [positions, vocab], got {values.dtype} {values.shape}")
    return values


@dataclass
class Report:
    """The outcome: ``problems`` (missing files, shape mismatches) fail the check like an error over the bound."""

    tolerance: float
    worst: Worst | None = None
    problems: list[str] = field(default_factory=list)
    rows: int = 0  # positions compared
    over: int = 0  # positions whose error exceeds the tolerance

    @property
    def passed(self) -> bool:
        return not self.problems and self.worst is not None and self.over == 0


def compare(ref: Path, ours: Path, tolerance: float = TOLERANCE) -> Report:
    """Every position of every paired file checked with the rule of the module docstring."""
    report = Report(tolerance)
    problems = report.problems
    for name, ref_file, our_file in pair_files(ref, ours):
        if not our_file.is_file():
            problems.append(f"{name}: missing in {ours}")
            continue
        b, a = _load(ref_file), _load(our_file)
        if a.shape != b.shape:
            problems.append(f"{name}: shape {a.shape}, reference {b.shape}")
            continue
        if not len(b):
            continue
        errors = row_errors(a, b)
        report.rows += len(errors)
        report.over += int(np.count_nonzero(~(errors <= tolerance)))
        k = int(np.argmax(errors))
        if report.worst is None or errors[k] > report.worst.error:
            report.worst = Worst(name, k, float(errors[k]), mean_error(a[k], b[k]))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", type=Path, help="reference .npy file or directory")
    parser.add_argument("ours", type=Path, help="our .npy file or directory (same names)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="largest relative error (%(default)s)")
    args = parser.parse_args(argv)
    try:
        report = compare(args.ref, args.ours, args.tolerance)
    except InputError as exc:
        print(f"check_precision: error: {exc}", file=sys.stderr)
        return 2
    for problem in report.problems:
        print(f"FAIL {problem}")
    worst = report.worst
    if worst is None:
        print("no positions compared")
    else:
        verdict = "<=" if worst.error <= args.tolerance else ">"
        print(f"{report.rows} positions compared, {report.over} over the tolerance; worst token: {worst.name} "
              f"position {worst.position}: relative error {worst.error:.3e} {verdict} {args.tolerance:g} "
              f"(max |ours - ref| / max |ref|; its mean relative error {worst.mean_error:.3e})")
    print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
