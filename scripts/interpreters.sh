#!/usr/bin/env bash
# The one abi3 wheel on the other CPython versions it supports (3.12, 3.13), where this machine
# has them (on PATH, or pyenv's): the wheel is built once, installed into a fresh virtual
# environment per interpreter beside NumPy and the test tools, and the Python tests run there
# against it. On 3.12 beside NumPy 1 (the package supports NumPy from 1.22: its last line, 1.26,
# is still what many environments pin), on 3.13 beside NumPy 2. An interpreter this machine lacks
# is named and skipped. Run after scripts/test.sh, which makes .venv (and its maturin).
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n==> %s\n' "$*"; }

# The first candidate that runs (a pyenv shim on PATH may name a version it cannot start).
find_python() {
    local v=$1 c
    for c in "$(command -v "python$v" || true)" \
        "$(ls -d "$HOME"/.pyenv/versions/"$v".*/bin/python"$v" 2>/dev/null | sort -V | tail -1 || true)"; do
        if [ -n "$c" ] && "$c" -c 'import sys, venv' >/dev/null 2>&1; then
            echo "$c"
            return 0
        fi
    done
    return 0
}

step "the abi3 wheel, built once"
wheels=target/abi3-wheel
rm -rf "$wheels"
.venv/bin/maturin build --release --quiet -o "$wheels"
wheel=$(ls "$wheels"/*.whl)
echo "$wheel"

for v in 3.12 3.13; do
    numpy="numpy>=2"
    [ "$v" = 3.12 ] && numpy="numpy>=1.26,<2"
    step "python tests on CPython $v with $numpy, against the abi3 wheel"
    py=$(find_python "$v")
    if [ -z "$py" ]; then
        echo "skipped: no CPython $v on this machine (neither python$v on PATH nor pyenv's)"
        continue
    fi
    env=target/venv-$v
    rm -rf "$env"
    "$py" -m venv "$env"
    "$env/bin/python" -m pip install -q --disable-pip-version-check "$numpy" "pytest>=8" \
        "pytest-timeout>=2" "hypothesis>=6.100" "$wheel"
    # The repository's root holds no `rustws` package (the sources are under python/), so the
    # tests import the wheel just installed.
    "$env/bin/python" -c 'import numpy, rustws, sys; print(sys.version.split()[0], numpy.__version__, rustws.__file__)'
    "$env/bin/python" -m pytest -q -p no:cacheprovider
done
