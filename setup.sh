#!/usr/bin/env bash
# Idempotent set-up: the sandbox tool (bubblewrap, when we can install it) and a virtual environment
# in .venv with requirements.txt. Safe to run again; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }) \
      || echo "setup: could not install bubblewrap; the grader falls back to unshare + resource limits" >&2
  else
    echo "setup: bubblewrap (bwrap) is missing; install it for the strongest grader sandbox" >&2
  fi
fi
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if ! .venv/bin/python -c "import torch, transformers, gguf, datasets, requests, tqdm, pytest" 2>/dev/null \
   || [ requirements.txt -nt .venv/.installed ]; then
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
  touch .venv/.installed
fi
