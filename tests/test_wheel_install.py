"""``pip install .`` (not editable) gives a package that serves: the wheel carries every file the server
needs at run time (the native kernels' sources and header, the tokenizer corpus, the entry point).

The wheel is installed without dependencies into a fresh venv whose only other path is this environment's
site-packages (a ``.pth`` line: nested ``.pth`` files, such as this checkout's editable install, are not
processed there), and served from outside the checkout, so every import resolves to the installed copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from llm_serving.bench.local_server import stop

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """\
model_config: {seq_length: [32], prefill_batch_size: [2], decode_batch_size: [4], kernels: native}
pa_config: {num_blocks: 64, block_size: 8, decode_seq_length: 64}
serving_config: {server_port: 0}
default_model: {data_dir: DATA, weights: random, hidden_size: 64, intermediate_size: 160, num_layers: 2, num_heads: 4,
                num_kv_heads: 2, vocab_size: 1000}
"""


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, **kw)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a copy: an in-tree build would leave build/ and *.egg-info in the checkout
    files = run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT).stdout.splitlines()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp),
         str(source)], cwd=tmp)
    wheel = next(tmp.glob("llm_serving-*.whl"))
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    Path(site, "deps_from_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)])
    return venv


def test_the_wheel_holds_the_run_time_files(installed):
    python = str(installed / "bin" / "python")
    code = ("import agents, llm_serving, loadtest, pathlib, sys\n"
            "for m in (agents, llm_serving, loadtest):\n"
            "    print(pathlib.Path(m.__file__).parent)\n")
    dirs = [Path(p) for p in run([python, "-c", code], cwd=installed).stdout.split()]
    assert all(str(d).startswith(str(installed)) for d in dirs), dirs  # not this checkout
    kernels = dirs[0] / "model" / "kernels"
    assert (kernels / "common.h").is_file() and list(kernels.glob("*.cc"))
    assert (dirs[1] / "bench" / "data" / "corpus.txt").is_file()  # the workloads' and the default tokenizer's text
    for model in ("target", "draft"):  # the shipped trained pair (default_model.weights: trained)
        assert {p.name for p in (dirs[1] / "models" / "pydoc" / model).iterdir()} >= {
            "config.json", "model.safetensors", "tokenizer.model",
            "tokenizer_config.json", "tokenizer.json"}  # (AutoTokenizer's, with or without sentencepiece)


def test_the_installed_package_serves(installed, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(CONFIG.replace("DATA", str(tmp_path / "models")))
    env = {**os.environ, "HOME": str(tmp_path)}  # a fresh kernel cache: the kernels compile from the wheel
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen([str(installed / "bin" / "llm-serving"), "serve", "--config", str(config)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"ready in .* at (http://\S+)", line)
            if found:
                url = found.group(1)
                break
        assert url, "".join(lines[-40:])
        body = json.dumps({"inputs": "The river ran", "parameters": {"max_new_tokens": 5}}).encode()
        req = urllib.request.Request(f"{url}/models/llama2/generate", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
        assert answer["generated_tokens"] == 5 and answer["finish_reason"] == "length"
    finally:
        stop(proc, signal.SIGTERM)
