"""scripts/check_precision.py: the rule (per position max|ours - ref| / max|ref| <= 5 per mille) and its verdicts.
Against Hugging Face logits it is exercised in tests/test_logits_dump.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_precision.py"
spec = importlib.util.spec_from_file_location("check_precision", SCRIPT)
check_precision = sys.modules["check_precision"] = importlib.util.module_from_spec(spec)  # dataclasses need it
spec.loader.exec_module(check_precision)


def logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> np.ndarray:
    return (4 * np.random.default_rng(seed).standard_normal((rows, vocab))).astype(np.float32)


def test_error_is_relative_to_the_rows_scale_not_to_each_entry():
    ref = logits()
    ref[0, 7] = 1e-6  # a logit near zero: an element-wise relative error would explode here
    ours = ref.copy()
    ours[0, 7] += 1e-3
    ours[1] += 0.004 * np.abs(ref[1]).max()  # 4 per mille of the row's scale on every entry
    errors = check_precision.row_errors(ours, ref)
    assert errors[0] == pytest.approx(1e-3 / np.abs(ref[0]).max(), rel=1e-5)
    assert errors[1] == pytest.approx(0.004, rel=1e-4) and errors[2] == 0
    ours[2, 3] = np.nan
    assert check_precision.row_errors(ours, ref)[2] == np.inf


def save(folder: Path, **arrays: np.ndarray) -> Path:
    folder.mkdir()
    for name, values in arrays.items():
        np.save(folder / f"{name}.npy", values)
    return folder


def test_verdicts_and_worst_token(tmp_path, capsys):
    ref = save(tmp_path / "ref", **{"0": logits(seed=0), "1": logits(seed=1), "10": logits(seed=2)})
    close = {k: np.load(ref / f"{k}.npy") * np.float32(1.003) for k in ("0", "1", "10")}
    assert check_precision.main([str(ref), str(save(tmp_path / "close", **close))]) == 0
    assert "PASS" in capsys.readouterr().out

    far = dict(close)
    far["10"] = far["10"].copy()
    far["10"][1, 4] += 0.01 * np.abs(far["10"][1]).max()
    assert check_precision.main([str(ref), str(save(tmp_path / "far", **far))]) == 1
    out = capsys.readouterr().out
    assert "worst token: 10.npy position 1" in out and out.rstrip().endswith("FAIL")

    short = {**close, "1": close["1"][:2]}
    del short["0"]
    assert check_precision.main([str(ref), str(save(tmp_path / "short", **short))]) == 1
    out = capsys.readouterr().out
    assert "0.npy: missing" in out and "1.npy: shape (2, 50), reference (3, 50)" in out

    (tmp_path / "bad.npy").write_text("not numpy")
    assert check_precision.main([str(tmp_path / "bad.npy"), str(ref / "0.npy")]) == 2
