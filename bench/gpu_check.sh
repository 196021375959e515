#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py), for a machine that reaches no package
# registry and has its own torch (the GPU image: torch 2.11, transformers
# 5.17, Python 3.12, no torchao, no kvexport).
#
#   bench/gpu_check.sh prepare
#       here, with the registry: kvexport as a wheel and the packages the
#       image lacks (torchao) as Python 3.12 wheels in .whl/ (git-ignored),
#       and their size against the 64 MiB a device run may carry.
#   bench/gpu_check.sh run OUT.json [--device cuda|cpu] [gpu_check.py options]
#       there (or here, --device cpu, for the dry run): installs .whl/ with
#       --no-deps into a target folder put first on PYTHONPATH, then runs the
#       check; its JSON goes to OUT.json.
set -euo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."
WHEELS=.whl
# what the image lacks (KINDS.md's package list); --no-deps: each is named
MISSING=("torchao==0.18.0")

prepare() {
    local PYTHON=${PYTHON:-.venv/bin/python}  # here: the project's venv (setuptools with bdist_wheel)
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" . 2>&1 | grep -v "^WARNING: Location" || true
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "${MISSING[@]}" 2>&1 | grep -v "^WARNING: Location" || true
    ls -l "$WHEELS"
    du -sb "$WHEELS" | awk '{printf "[gpu_check] %.1f MiB of wheels (a device run carries at most 64 MiB)\n", $1 / 1048576}'
}

run() {
    local PYTHON=${PYTHON:-python3}  # there: the image's python, which holds its torch
    local out; out=$(cd "$CALLER" && realpath -m "$1"); shift
    if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        local site=${KVEXPORT_SITE:-/tmp/kvexport-site}
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        KVEXPORT_WHEELS_MB=$(du -sb "$WHEELS" | awk '{printf "%.1f", $1 / 1048576}')
        export KVEXPORT_WHEELS_MB
    fi
    # the installed wheel, not this checkout's folders: bench/ is the only path added
    (cd bench && "$PYTHON" gpu_check.py --out "$out" "$@")
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; [ $# -ge 1 ] || { echo "usage: bench/gpu_check.sh run OUT.json [options]" >&2; exit 2; }; run "$@" ;;
    *) echo "usage: bench/gpu_check.sh prepare | run OUT.json [--device cuda|cpu] [options]" >&2; exit 2 ;;
esac
