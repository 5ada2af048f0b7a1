#!/usr/bin/env bash
# Creates .venv if missing, installs llm-serving with its test extra, runs the test suite.
# A whole-suite run (no pytest arguments) first runs tests_mindformers/ in the MindFormers environment
# (scripts/mindformers_env.sh: created once, ~1.5-2.5 min, then cached; the tests take ~30 s);
# LLM_SERVING_SKIP_MINDFORMERS=1 leaves them out. It also makes (once, ~1 min, cached) the lm-evaluation-harness
# environment tests/test_lm_eval.py runs lm-eval from (scripts/lm_eval_env.sh; LLM_SERVING_SKIP_LM_EVAL=1: not).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -m ruff check .
if [ $# -eq 0 ] && [ -z "${LLM_SERVING_SKIP_MINDFORMERS:-}" ]; then
  MF_PYTHON="$(bash scripts/mindformers_env.sh)"
  "$MF_PYTHON" -m pytest -q -p no:logging tests_mindformers
fi
if [ $# -eq 0 ] && [ -z "${LLM_SERVING_SKIP_LM_EVAL:-}" ]; then
  LLM_SERVING_LM_EVAL_PYTHON="$(bash scripts/lm_eval_env.sh)"
  export LLM_SERVING_LM_EVAL_PYTHON
fi
exec .venv/bin/python -m pytest -q "$@"
