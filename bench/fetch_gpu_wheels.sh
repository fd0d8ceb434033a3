#!/usr/bin/env bash
# The wheels the GPU machine needs to import xgrammar, fetched here (it has no network), into
# .whl/ at the repository root (ignored by git). Carry that folder with the device tool
# (carry: [".whl"]) and bench/gpu.sh unpacks them into a temporary folder on every step's path
# (bench/gpu_check.py NOTE 1), so structured outputs' tests run on the GPU instead of skipping.
#   bash bench/fetch_gpu_wheels.sh [--dest DIR] [--python-version 3.12]
# CPython 3.12 (the GPU machine's) on manylinux x86_64 by default; --python-version 3.11 fetches
# the same pins for this machine's venvs, to check the mechanism here. Idempotent: a pinned wheel
# already in DIR is not fetched again; a wheel there that no pin names (an older pin), or built for
# another Python, is removed.
#
# The pins: xgrammar inside pyproject.toml's range (>=0.2.9,<0.3), the version the dev venv has,
# and what it imports at import time (its METADATA's Requires-Dist, checked by importing it from
# a folder holding only these): apache-tvm-ffi (its bindings' loader), pydantic (its JSON-schema
# types) with pydantic-core, annotated-types and typing-inspection, and typing-extensions
# (pydantic 2.14 needs >= 4.16, newer than torch asks for). Not fetched: torch, transformers,
# triton and numpy (the GPU machine has them; torch is GBs); sentencepiece and tiktoken (xgrammar
# imports them only if present, for tokenizers the tests do not use); ninja (tvm-ffi's "cpp"
# extra, to build extensions). About 7.5 MB in all, against the device tool's 64 MiB of carry.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=.whl
PYVER=3.12
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) DEST="$2"; shift 2 ;;
    --python-version) PYVER="$2"; shift 2 ;;
    *) echo "fetch_gpu_wheels.sh: unknown argument $1 (--dest DIR, --python-version X.Y)" >&2; exit 2 ;;
  esac
done
if ! [[ "$PYVER" =~ ^3\.[0-9]+$ ]]; then
  echo "fetch_gpu_wheels.sh: --python-version must be like 3.12, got '$PYVER'" >&2
  exit 2
fi

PINS=(
  xgrammar==0.2.9
  apache-tvm-ffi==0.1.15.post2
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
)
PYTHON="${PYTHON:-python3}"
mkdir -p "$DEST"
shopt -s nullglob nocaseglob

# A wheel's file name starts with its name (lower case, '-' as '_') and its version.
prefix() { local pin="$1"; local name="${pin%%==*}"; name="${name//-/_}"; echo "${name,,}-${pin##*==}-"; }

# Whether a wheel's Python tag (third field from the end, '.'-separated alternatives) fits $PYVER.
fits() {
  local tag; tag="$(basename "$1" .whl | awk -F- '{print $(NF-2)}')"
  [[ ".$tag." =~ \.(py3|cp${PYVER/./})\. ]]
}

known=()
for pin in "${PINS[@]}"; do known+=("$(prefix "$pin")"); done
for wheel in "$DEST"/*.whl; do
  base="$(basename "$wheel")"
  keep=0
  for p in "${known[@]}"; do [[ "${base,,}" == "$p"* ]] && keep=1; done
  if [ "$keep" = 0 ]; then echo "removing $base: no pin names it"; rm -f "$wheel"
  elif ! fits "$wheel"; then echo "removing $base: not for CPython $PYVER"; rm -f "$wheel"; fi
done

missing=()
for pin in "${PINS[@]}"; do
  p="$(prefix "$pin")"
  have=("$DEST/$p"*.whl)
  if [ ${#have[@]} -gt 0 ]; then
    echo "have $pin"
  else
    missing+=("$pin")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "fetching ${missing[*]} for CPython $PYVER, manylinux x86_64"
  "$PYTHON" -m pip download --disable-pip-version-check --quiet --only-binary=:all: --no-deps \
    --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DEST" "${missing[@]}"
fi

ls -l "$DEST"/*.whl | awk '{printf "%10d  %s\n", $5, $NF}'
du -cb "$DEST"/*.whl | tail -1 | awk '{printf "total: %d bytes (%.1f MiB), %s\n", $1, $1 / 1048576, "'"$DEST"'"}'
