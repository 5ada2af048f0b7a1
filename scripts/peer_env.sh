#!/usr/bin/env bash
# Creates (once) the environment of one CPU peer for scripts/benchmark.py --peers and prints its python's path.
#
# Why separate venvs: each peer pins its own transformers/torch range (optimum-intel for the OpenVINO export,
# ct2-transformers-converter for CTranslate2), none of which may disturb the project's .venv. torch comes from
# the CPU wheel the machine provides (find-links), never the CUDA build. Idempotent: a venv whose stamp (this
# script's pins) matches is reused; otherwise it is made anew.
#
#   bash scripts/peer_env.sh openvino|ctranslate2     # create or reuse; prints the venv's python
#   LLM_SERVING_PEERS_DIR=DIR bash scripts/...        # somewhere else (default ~/.cache/llm-serving/peers)
set -euo pipefail
cd "$(dirname "$0")/.."
NAME="${1:?usage: peer_env.sh openvino|ctranslate2}"
TORCH="torch==2.13.0+cpu"
case "$NAME" in
  openvino)
    VERSION=2026.4.1.0
    PKGS=("openvino-genai==$VERSION" "openvino-tokenizers==$VERSION" "openvino==$VERSION" "optimum-intel==2.2.0" "transformers==5.5.4"
          "nncf" "$TORCH" "sentencepiece" "protobuf" "numpy<2.3")
    # optimum-intel pulls torchvision from PyPI, whose build does not load with the CPU torch (transformers
    # then fails to import); nothing here uses it
    POST=("uninstall" "-y" "-q" "torchvision")
    CHECK="import openvino_genai as g, transformers; print('openvino_genai', g.__version__)" ;;
  ctranslate2)
    VERSION=4.8.5
    PKGS=("ctranslate2==$VERSION" "transformers==5.23.0" "$TORCH" "sentencepiece" "protobuf" "numpy<2.3")
    POST=()
    CHECK="import ctranslate2 as c, transformers; print('ctranslate2', c.__version__)" ;;
  *) echo "unknown peer $NAME (openvino, ctranslate2)" >&2; exit 2 ;;
esac
VENV="${LLM_SERVING_PEERS_DIR:-$HOME/.cache/llm-serving/peers}/$NAME-$VERSION"
STAMP="$NAME ${PKGS[*]} $(sha1sum < scripts/peer_env.sh | cut -c1-12)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.llm-serving-stamp" 2>/dev/null)" = "$STAMP" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
echo "creating the $NAME environment in $VENV (${PKGS[*]})" >&2
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip >&2
"${PIP[@]}" "${PKGS[@]}" >&2
if [ ${#POST[@]} -gt 0 ]; then "$VENV/bin/python" -m pip "${POST[@]}" >&2; fi
"$VENV/bin/python" -c "$CHECK" >&2
echo "$STAMP" > "$VENV/.llm-serving-stamp"
echo "$VENV/bin/python"
