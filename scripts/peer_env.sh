#!/usr/bin/env bash
# Creates (once) the environment of one CPU peer for scripts/benchmark.py --peers and prints its python's path.
#
# Why separate venvs: each peer pins its own transformers/torch range (optimum-intel for the OpenVINO export,
# ct2-transformers-converter for CTranslate2, llama.cpp's convert_hf_to_gguf.py), none of which may disturb the
# project's .venv. torch comes from the CPU wheel the machine provides (find-links), never the CUDA build.
# Idempotent: a venv whose stamp matches is reused; otherwise it is made anew. The stamp covers only that peer's
# own pins (packages, build flags, the text of its post-install step), so editing another peer's lines here does
# not rebuild the slow venvs that did not change.
#
#   bash scripts/peer_env.sh openvino|ctranslate2|llamacpp   # create or reuse; prints the venv's python
#   LLM_SERVING_PEERS_DIR=DIR bash scripts/...               # somewhere else (default ~/.cache/llm-serving/peers)
set -euo pipefail
cd "$(dirname "$0")/.."
NAME="${1:?usage: peer_env.sh openvino|ctranslate2|llamacpp}"
TORCH="torch==2.13.0+cpu"
BUILD=""      # environment of a source build (its flags), part of the stamp
BUILD_CPU=""  # the CPU flags a native build is for, part of the stamp
SDIST=""      # the source archive a post-install step builds, with its sha256, part of the stamp

post_openvino() {
  # optimum-intel pulls torchvision from PyPI, whose build does not load with the CPU torch (transformers then
  # fails to import); nothing here uses it
  "$VENV/bin/python" -m pip uninstall -y -q torchvision
}

post_llamacpp() {
  # llama-cpp-python is an sdist on PyPI (its wheels live elsewhere): pip builds the vendored llama.cpp with
  # cmake. The same sdist carries llama.cpp's HF -> GGUF converter and its gguf-py, taken from it (not from
  # GitHub) into share/llama.cpp; gguf-py is also installed for its dependencies.
  local src="$VENV/src" share="$VENV/share/llama.cpp" tarball vendor="llama_cpp_python-$VERSION/vendor/llama.cpp"
  mkdir -p "$src" "$share"
  "$VENV/bin/python" -m pip download -q --no-binary :all: --no-deps -d "$src" "llama-cpp-python==$VERSION"
  tarball="$src/llama_cpp_python-$VERSION.tar.gz"
  echo "${SDIST##* sha256:}  $tarball" | sha256sum -c --quiet
  echo "building llama.cpp ($BUILD), several minutes" >&2
  env "$BUILD" "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$tarball"
  tar -xzf "$tarball" -C "$share" --strip-components=3 "$vendor/convert_hf_to_gguf.py" "$vendor/conversion" \
    "$vendor/gguf-py"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$share/gguf-py"
  rm -rf "$src"
}

case "$NAME" in
  openvino)
    VERSION=2026.4.1.0
    PKGS=("openvino-genai==$VERSION" "openvino-tokenizers==$VERSION" "openvino==$VERSION" "optimum-intel==2.2.0" "transformers==5.5.4"
          "nncf" "$TORCH" "sentencepiece" "protobuf" "numpy<2.3")
    CHECK="import openvino_genai as g, transformers; print('openvino_genai', g.__version__)" ;;
  ctranslate2)
    VERSION=4.8.5
    PKGS=("ctranslate2==$VERSION" "transformers==5.23.0" "$TORCH" "sentencepiece" "protobuf" "numpy<2.3")
    CHECK="import ctranslate2 as c, transformers; print('ctranslate2', c.__version__)" ;;
  llamacpp)
    VERSION=0.3.36
    SDIST="llama-cpp-python==$VERSION sha256:832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    # the converter's own pins (vendor/llama.cpp/requirements/requirements-convert_hf_to_gguf.txt) but torch,
    # which is the machine's CPU wheel
    PKGS=("transformers==4.57.6" "$TORCH" "sentencepiece==0.2.3" "protobuf==4.25.9" "numpy==2.2.6")
    # built for this CPU (-march=native; OpenMP, llama.cpp's default), no BLAS, no GPU, no multimodal library;
    # the CPU's flags are in the stamp, so a venv copied to another CPU is rebuilt rather than crashing
    BUILD="CMAKE_ARGS=-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DLLAVA_BUILD=OFF"
    BUILD_CPU="$(grep -m1 '^flags' /proc/cpuinfo | sha1sum | cut -c1-12)"
    CHECK="import llama_cpp, gguf, os, sys
assert os.path.isfile(os.path.join(sys.prefix, 'share/llama.cpp/convert_hf_to_gguf.py'))
print('llama_cpp', llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())" ;;
  *) echo "unknown peer $NAME (openvino, ctranslate2, llamacpp)" >&2; exit 2 ;;
esac
VENV="${LLM_SERVING_PEERS_DIR:-$HOME/.cache/llm-serving/peers}/$NAME-$VERSION"
POST=""
if declare -F "post_$NAME" >/dev/null; then POST="post_$NAME"; fi
STAMP="$NAME ${PKGS[*]}${SDIST:+ | $SDIST}${BUILD:+ | $BUILD}${BUILD_CPU:+ | cpu flags $BUILD_CPU}"
STAMP+="${POST:+ | $POST $(declare -f "$POST" | sha1sum | cut -c1-12)}"
source scripts/cached_venv.sh
reuse_venv "$VENV" "$STAMP"
echo "creating the $NAME environment in $VENV (${PKGS[*]})" >&2
new_venv "$VENV"
"${PIP[@]}" "${PKGS[@]}" >&2
if [ -n "$POST" ]; then "$POST" >&2; fi
"$VENV/bin/python" -c "$CHECK" >&2
stamp_venv "$VENV" "$STAMP"
