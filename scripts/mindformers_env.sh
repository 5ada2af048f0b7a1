#!/usr/bin/env bash
# Creates (once) the separate MindFormers environment and prints its python's path.
#
# Why separate: MindFormers 1.8.0, the newest release that installs with an installable MindSpore, needs
# MindSpore 2.7.2, while this project pins mindspore==2.10.0. So this venv holds MindSpore 2.7.2 + MindFormers
# 1.8.0 + this project installed without its dependencies (--no-deps, then its other dependencies by hand).
# Our patches are applied to its MindFormers. Idempotent: a venv whose stamp (this script, the patches) matches is
# reused as it is; otherwise it is made anew.
#
#   bash scripts/mindformers_env.sh            # create or reuse; prints the venv's python
#   LLM_SERVING_MF_VENV=DIR bash scripts/...   # somewhere else (default ~/.cache/llm-serving/venv-mindformers-1.8.0)
set -euo pipefail
cd "$(dirname "$0")/.."
MINDSPORE_VERSION=2.7.2
MINDFORMERS_VERSION=1.8.0
VENV="${LLM_SERVING_MF_VENV:-$HOME/.cache/llm-serving/venv-mindformers-$MINDFORMERS_VERSION}"
# a change to this script (pins, dependencies) or to the patches makes a new environment
STAMP="mindspore==$MINDSPORE_VERSION mindformers==$MINDFORMERS_VERSION $(cat scripts/mindformers_env.sh patches/mindformers-$MINDFORMERS_VERSION/*.patch | sha1sum | cut -c1-12)"
source scripts/cached_venv.sh
reuse_venv "$VENV" "$STAMP"
echo "creating the MindFormers environment in $VENV (MindSpore $MINDSPORE_VERSION, MindFormers $MINDFORMERS_VERSION)" >&2
new_venv "$VENV"
"${PIP[@]}" "mindspore==$MINDSPORE_VERSION" "mindformers==$MINDFORMERS_VERSION" "numpy<2" >&2
# this project without its mindspore pin, then the dependencies the agents and the tests need (pip then reports
# that pin as a conflict: expected, MindSpore 2.7.2 is this environment's point)
"${PIP[@]}" --no-deps -e . >&2
"${PIP[@]}" sentencepiece pyyaml aiohttp safetensors prometheus_client tqdm jinja2 protobuf pytest "numpy<2" >&2
# our patches (patches/mindformers-$MINDFORMERS_VERSION): version check, dry run, then applied
"$VENV/bin/python" -m llm_serving.cli.commands.patch_mindformers >&2
"$VENV/bin/python" -c "import mindspore, mindformers; print('mindspore', mindspore.__version__, 'mindformers', mindformers.__version__)" >&2
stamp_venv "$VENV" "$STAMP"
