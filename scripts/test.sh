#!/usr/bin/env bash
# Every check and every test, Rust and Python, from a fresh clone: builds the extension into a
# local virtual environment (.venv), then runs formatting, lints, the stub check, the Rust tests
# and the Python tests. Exits non-zero on the first failure. The core under Miri and the
# sanitizers is scripts/sanitizers.sh (CI runs both).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
step() { printf '\n==> %s\n' "$*"; }

step "python tools"
$VPY -m pip install -q --disable-pip-version-check "maturin>=1.7,<2" "numpy>=1.22" "pytest>=8" \
    "pytest-timeout>=2" "hypothesis>=6.100" "ruff>=0.5" "mypy>=1.10"
step "optional extras the tests cover (dask: rustws.dask on a LocalCluster)"
$VPY -m pip install -q --disable-pip-version-check "dask>=2023.1" "distributed>=2023.1"
step "optional: Ray (@rustws.cycle on Ray tasks and actors; its tests skip, saying why, without it)"
$VPY -m pip install -q --disable-pip-version-check "ray>=2.9" ||
    echo "skipped: Ray did not install here; tests/capture/test_ray.py will skip"

step "build the extension (release)"
.venv/bin/maturin develop --release --quiet

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
step "ruff"
.venv/bin/ruff check python tests benches scripts
.venv/bin/ruff format --check python tests benches scripts
step "stubs match the module"
$VPY -m mypy.stubtest rustws._rustws

step "rust tests"
cargo test -p rustws-core --quiet
step "python tests"
$VPY -m pytest -q
