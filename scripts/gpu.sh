#!/usr/bin/env bash
# The device checks, on a machine with an NVIDIA GPU and its driver (PyTorch and CuPy where
# installed): the real-GPU tests, the device benchmarks, the device tests under compute-sanitizer's
# memcheck where it is installed, and the whole Python suite (limited to SUITE_TIMEOUT seconds).
# Every log goes to OUTDIR.
#
#     bash scripts/gpu.sh OUTDIR [WHEEL]
#
# With WHEEL (a built rustws wheel), it is installed into a private folder first (no network, no
# dependencies fetched); without it, the rustws already importable is tested. Exits non-zero when
# any step failed, after running them all.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage: bash scripts/gpu.sh OUTDIR [WHEEL]}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -n "${2:-}" ]; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$2" || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
failed=0
run() { # run NAME CMD...: CMD's output to OUTDIR/NAME.log; a failure is remembered
    local name=$1
    shift
    printf '\n==> %s\n' "$*" | tee -a "$OUTDIR/$name.log"
    "$@" 2>&1 | tee -a "$OUTDIR/$name.log" || failed=1
}

{
    nvidia-smi || true
    "$PY" - <<'PY'
import importlib, platform
print("python", platform.python_version())
for name in ("rustws", "numpy", "torch", "cupy", "jax"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"), getattr(m, "__file__", ""))
    except Exception as e:
        print(name, "unavailable:", e)
import rustws
print("rustws.cuda:", rustws.cuda.device_count(), "device(s);", rustws.cuda.unavailable_reason(0) or "usable")
PY
} >"$OUTDIR/info.log" 2>&1

run test_cuda "$PY" -m pytest -p no:cacheprovider tests/devices/test_cuda.py -v -rs
run bench "$PY" benches/gpu.py --out "$OUTDIR/gpu.json"
# Under memcheck, less the test that asks the driver for 1 PiB: the sanitizer reports the refusal
# that the test provokes (an API error, not a memory error).
if command -v compute-sanitizer >/dev/null; then
    XLA_PYTHON_CLIENT_PREALLOCATE=false run memcheck timeout 300 compute-sanitizer --tool memcheck \
        --error-exitcode 3 "$PY" -m pytest -p no:cacheprovider tests/devices/test_cuda.py -q -rs \
        -k "not out_of_memory"
else
    echo "compute-sanitizer is not installed: no memcheck run" | tee "$OUTDIR/memcheck.log"
fi
# The whole suite last: it needs the GPU least, and a lease that runs short still has the rest.
run suite timeout "${SUITE_TIMEOUT:-600}" "$PY" -m pytest -p no:cacheprovider tests -q -rs \
    --ignore tests/devices/test_cuda.py
exit $failed
