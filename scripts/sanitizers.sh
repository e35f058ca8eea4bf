#!/usr/bin/env bash
# The core under the checkers, as CI runs it:
#   - Miri (nightly; its component is installed when missing) over the core's unit tests, the
#     allocator programs and failure injection (property tests, with RUSTWS_PROPTEST_CASES cases,
#     3 by default: a case costs minutes under Miri), the limit and double-free tests, the recorded
#     history, frees from other threads, and the conformance and adaptive tests, at the sizes
#     `miri_or` gives them under Miri; all through the arena and workspace code, without the CUDA
#     feature (Miri loads no driver);
#   - AddressSanitizer, with LeakSanitizer and its quarantine, over every test of the core (the
#     CUDA backends over the driver stand-in included, property tests at their full case counts), on
#     the stable toolchain, built with `--cfg rustws_asan`: free arena blocks, cached blocks and
#     cached huge mappings are poisoned, and tests/poison.rs checks that reading them is reported;
#   - ThreadSanitizer over the same tests (tests/threads.rs frees from other threads while the owner
#     allocates and closes cycles), with the standard library rebuilt instrumented (nightly).
# A checker that cannot be installed or run here is skipped with the reason; one that runs and
# finds an error fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n==> %s\n' "$*"; }
skip() { printf 'skipped: %s\n' "$*"; }

# -- Miri --------------------------------------------------------------------------------------------
# Every conformance test but the one over a named file (Miri maps no files).
MIRI_CONFORMANCE_SKIP=(a_named_mmap_file)

miri_available() {
    if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
        echo "installing the nightly toolchain with miri"
        rustup toolchain install nightly --profile minimal --component miri rust-src >/dev/null 2>&1 ||
            { skip "no nightly toolchain, and installing one failed (offline?)"; return 1; }
    fi
    if ! cargo +nightly miri --version >/dev/null 2>&1; then
        echo "installing the miri component of the nightly toolchain"
        rustup component add miri rust-src --toolchain nightly >/dev/null 2>&1 ||
            { skip "the nightly toolchain has no miri component and adding it failed (offline, or none for this nightly)"; return 1; }
    fi
    cargo +nightly miri setup >/dev/null 2>&1 || { skip "cargo miri setup failed: $(cargo +nightly miri setup 2>&1 | tail -1)"; return 1; }
}

step "miri: unit tests, allocator programs, failure injection, conformance"
if miri_available; then
    export MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}"
    export RUSTWS_PROPTEST_CASES="${RUSTWS_MIRI_CASES:-3}"
    miri() { cargo +nightly miri test -p rustws-core --no-default-features --quiet "$@"; }
    miri --lib
    miri --test programs --test faults --test limit --test threads --test history
    miri --test conformance -- $(printf -- '--skip %s ' "${MIRI_CONFORMANCE_SKIP[@]}")
    miri --test adaptive
    # The sanitizers below run the property tests at their full case counts.
    unset RUSTWS_PROPTEST_CASES
else
    echo "checking that the core still builds under cfg(miri) (its shims for madvise, sysconf, mmap)"
    RUSTFLAGS="--cfg miri" cargo check -p rustws-core --lib --tests --no-default-features --quiet \
        --target-dir target/miri-cfg-check
fi

# -- AddressSanitizer ----------------------------------------------------------------------------------
step "AddressSanitizer: every test of the core"
host=$(rustc -vV | sed -n 's/^host: //p')
probe=$(mktemp -d)
if [ "$host" != "x86_64-unknown-linux-gnu" ]; then
    skip "AddressSanitizer runs here on x86_64-unknown-linux-gnu only (host is $host)"
elif ! why=$(echo 'fn main() {}' | RUSTC_BOOTSTRAP=1 rustc -Zsanitizer=address --target "$host" \
    -o "$probe/probe" - 2>&1); then
    skip "this toolchain cannot build with -Zsanitizer=address: $(echo "$why" | head -3)"
else
    # allocator_may_return_null: tests check that requests no address space holds are refused, as
    # the system allocator refuses them (ASan would abort instead). The quarantine stays on: freed
    # C-heap blocks are not handed out again at once, so a use after free is caught.
    echo "not under ASan: the residency tests (rust/core/tests/residency.rs), which measure the"
    echo "process's resident size (ASan's shadow memory and allocator caches are part of it, and its"
    echo "allocator takes no mallopt); they run in the plain test run"
    ASAN_OPTIONS="allocator_may_return_null=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}" \
        RUSTC_BOOTSTRAP=1 RUSTFLAGS="-Zsanitizer=address --cfg rustws_asan" \
        cargo test -p rustws-core --lib --tests --target "$host" --target-dir target/asan --quiet
fi
rm -rf "$probe"

# -- ThreadSanitizer -----------------------------------------------------------------------------------
# The standard library is rebuilt instrumented (-Zbuild-std), so that its atomics and locks are seen;
# about 3 minutes here. A race report fails the run (halt_on_error).
step "ThreadSanitizer: every test of the core (nightly, -Zbuild-std)"
tsan() {
    TSAN_OPTIONS="halt_on_error=1:allocator_may_return_null=1${TSAN_OPTIONS:+:$TSAN_OPTIONS}" \
        RUSTFLAGS="-Zsanitizer=thread --cfg rustws_tsan" cargo +nightly test -Zbuild-std -p rustws-core --lib --tests \
        --target "$host" --target-dir target/tsan --quiet "$@"
}
if [ "$host" != "x86_64-unknown-linux-gnu" ]; then
    skip "ThreadSanitizer runs here on x86_64-unknown-linux-gnu only (host is $host)"
elif ! cargo +nightly --version >/dev/null 2>&1; then
    skip "no nightly toolchain (ThreadSanitizer needs -Zbuild-std)"
elif ! rustup component add rust-src --toolchain nightly >/dev/null 2>&1 &&
    ! rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^rust-src'; then
    skip "the nightly toolchain has no rust-src component and adding it failed (-Zbuild-std needs it)"
elif ! why=$(tsan --no-run 2>&1); then
    skip "the core does not build under -Zsanitizer=thread here: $(echo "$why" | tail -3)"
else
    echo "not under TSan: the residency tests (its shadow memory is part of the resident size, and"
    echo "its allocator takes no mallopt)"
    tsan
fi
