"""Run a test's Python source in a fresh process rooted at the repository.

Why: MindSpore refuses every later step of a process once a kernel failed, so kernel error paths are checked in a
child process; graph mode compiles only code that lives in a file, so the source is written to one first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
