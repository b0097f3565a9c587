#!/usr/bin/env bash
# check_cuda.sh: compile every kernel file in cuda/ with nvcc for sm_80 and sm_90, no GPU needed.
#
#   tools/check_cuda.sh [FILE.cu ...]        (default: every file that kernel_specs lists; a name
#                                            that is not an existing path is looked up in cuda/)
#
# Each file is compiled together with the explicit template instantiations that kernel_specs.py
# declares for it (so a signature that disagrees with kernel_specs is a compile error), with
# warnings as errors and `-Xptxas -v`.  The run fails on any nvcc/ptxas error or warning and on
# any register spill ptxas reports; it ends with one line per kernel and architecture:
# registers, shared memory, stack, spills.  Environment: NVCC (default nvcc), PYTHON (default
# .venv/bin/python when there is one, else python3; it must import numpy).
# Exit status: 0 clean, 1 a file failed, 2 no nvcc.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
nvcc=${NVCC:-nvcc}
if [ -z "${PYTHON:-}" ] && [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; fi
python=${PYTHON:-python3}
if ! command -v "$nvcc" >/dev/null 2>&1; then
  echo "check_cuda.sh: nvcc not found; install the CUDA toolkit (12.x or 13.x) or set NVCC=/path/to/nvcc" >&2
  exit 2
fi

specs() { PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$python" -m rawinfer.backend.cuda.kernel_specs "$@"; }
if [ $# -gt 0 ]; then files=("$@"); else mapfile -t files < <(specs sources); fi
demangle() { if command -v c++filt >/dev/null 2>&1; then c++filt; else cat; fi; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
summary="$tmp/summary"
: > "$summary"
for path in "${files[@]}"; do
  if [ ! -f "$path" ]; then path="$root/cuda/$(basename "$path")"; fi
  path=$(cd "$(dirname "$path")" && pwd)/$(basename "$path")
  file=$(basename "$path")
  stem=${file%.cu}
  { echo "#include \"$path\""; specs instantiate "$file"; } > "$tmp/$stem.cu"
  log="$tmp/$stem.log"
  if ! "$nvcc" -std=c++17 -I"$root/cuda" \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
      --fatbin -Xptxas -v -Werror all-warnings -o "$tmp/$stem.fatbin" "$tmp/$stem.cu" > "$log" 2>&1; then
    echo "FAIL $file: nvcc reported errors or warnings:"
    grep -v "^ptxas info" "$log" | sed 's/^/    /'
    status=1
    continue
  fi
  # ptxas -v prints, per entry function and architecture:
  #   Compiling entry function 'NAME' for 'sm_90'
  #   Function properties for NAME
  #       S bytes stack frame, X bytes spill stores, Y bytes spill loads
  #   Used R registers, ... [N bytes smem] ...
  awk -v file="$file" '
    /Compiling entry function/ { split($0, q, "\047"); name = q[2]; arch = q[4] }
    /bytes stack frame/        { stack = $1; spills = $5 + $9 }
    /Used [0-9]+ registers/    { regs = 0; smem = 0
                                 for (i = 2; i <= NF; i++) {
                                   if ($i ~ /^registers/) regs = $(i - 1)
                                   if ($i ~ /^smem/ && $(i - 1) == "bytes") smem = $(i - 2)
                                 }
                                 printf "%-26s %-6s %4d regs %6d B smem %4d B stack %4d B spill  %s\n",
                                        file, arch, regs, smem, stack, spills, name }
' "$log" | demangle >> "$summary"
  if grep -Eq "[1-9][0-9]* bytes spill (stores|loads)" "$log"; then
    echo "FAIL $file: ptxas reports register spills:"
    grep -B2 -E "[1-9][0-9]* bytes spill (stores|loads)" "$log" | sed 's/^/    /'
    status=1
  fi
done
echo "file                       arch   registers  shared mem      stack      spills  kernel"
sort "$summary"
if [ "$status" -eq 0 ]; then echo "check_cuda.sh: ${#files[@]} files compiled for sm_80 and sm_90, no warnings, no spills"; fi
exit "$status"
