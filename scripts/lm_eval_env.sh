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
source scripts/cached_venv.sh
reuse_venv "$VENV" "$STAMP"
echo "creating the lm-evaluation-harness environment in $VENV (lm-eval $LM_EVAL_VERSION)" >&2
new_venv "$VENV"
"${PIP[@]}" "torch==2.13.0" "lm-eval[api]==$LM_EVAL_VERSION" >&2
"$VENV/bin/python" -c "import lm_eval; print('lm-eval', lm_eval.__version__)" >&2
stamp_venv "$VENV" "$STAMP"
