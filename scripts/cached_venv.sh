# Sourced by the scripts that make an environment of their own and cache it (mindformers_env.sh, lm_eval_env.sh,
# peer_env.sh): a venv is reused while the stamp it was made with matches, else made anew.

# reuse_venv VENV STAMP: when VENV was made with STAMP, print its python and end the calling script.
reuse_venv() {
  if [ -x "$1/bin/python" ] && [ "$(cat "$1/.llm-serving-stamp" 2>/dev/null)" = "$2" ]; then
    echo "$1/bin/python"
    exit 0
  fi
}

# new_venv VENV: an empty venv at VENV with a current pip; PIP is then its quiet install command.
new_venv() {
  rm -rf "$1"
  mkdir -p "$(dirname "$1")"
  python3 -m venv "$1"
  PIP=("$1/bin/python" -m pip install -q --disable-pip-version-check)
  "${PIP[@]}" --upgrade pip >&2
}

# stamp_venv VENV STAMP: mark VENV as made with STAMP and print its python.
stamp_venv() {
  echo "$2" > "$1/.llm-serving-stamp"
  echo "$1/bin/python"
}
