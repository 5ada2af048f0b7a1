#!/usr/bin/env bash
# Creates (once) an environment with EleutherAI's lm-evaluation-harness and prints its python's path, for
# tests/test_lm_eval.py (lm-eval's local-completions client run unmodified against our server).
#
# Why separate: lm-eval brings datasets, evaluate, scikit-learn and more that the server never needs. Its torch is
# pinned to the CPU build this machine has on disk (an unpinned one downloads a CUDA build of several GB).
# Idempotent: a venv whose stamp (this script) matches is reused as it is; otherwise it is made anew (~1 min).
#
#   bash scripts/lm_eval_env.sh             # create or reuse; prints the venv's python
#   LLM_SERVING_LM_EVAL_VENV=DIR bash ...   # somewhere else (default <cache root>/venv-lm-eval-0.4.13)
set -euo pipefail
cd "$(dirname "$0")/.."
LM_EVAL_VERSION=0.4.13
VENV="${LLM_SERVING_LM_EVAL_VENV:-${LLM_SERVING_CACHE_DIR:-$HOME/.cache/llm-serving}/venv-lm-eval-$LM_EVAL_VERSION}"
STAMP="lm-eval==$LM_EVAL_VERSION $(sha1sum < scripts/lm_eval_env.sh | cut -c1-12)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.llm-serving-stamp" 2>/dev/null)" = "$STAMP" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
echo "creating the lm-evaluation-harness environment in $VENV (lm-eval $LM_EVAL_VERSION)" >&2
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip >&2
"${PIP[@]}" "torch==2.13.0" "lm-eval[api]==$LM_EVAL_VERSION" >&2
"$VENV/bin/python" -c "import lm_eval; print('lm-eval', lm_eval.__version__)" >&2
echo "$STAMP" > "$VENV/.llm-serving-stamp"
echo "$VENV/bin/python"
