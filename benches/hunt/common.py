"""Shared harness: MODE=plain|captured chooses real workspaces or null stand-ins."""

import hashlib
import json
import os

import numpy as np

MODE = os.environ.get("MODE", "plain")
CAPTURED = MODE == "captured"
if CAPTURED:
    import rustws


class _NullWS:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def cycles(self, it):
        return iter(it)

    def stats(self):
        return None


def ws(name):
    if CAPTURED:
        return rustws.workspace(name)
    return _NullWS()


class Hasher:
    def __init__(self):
        self.h = hashlib.sha256()
        self.n = 0
        self.summ = []

    def add(self, a):
        a = np.ascontiguousarray(a)
        self.h.update(str((a.shape, a.dtype.str)).encode())
        self.h.update(a.tobytes())
        self.n += 1
        if a.dtype.kind in "fciub":
            self.summ.append(float(np.abs(a).sum(dtype=np.float64)) if a.size else 0.0)

    def hexdigest(self):
        return self.h.hexdigest()[:16]


def sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


class Kept:
    """Arrays kept across cycles, with their hash at creation; checked later."""

    def __init__(self):
        self.items = []
        self.errors = []

    def keep(self, a, tag=""):
        self.items.append((a, sha(a), tag))

    def drop_some(self, every=2):
        self.items = [x for i, x in enumerate(self.items) if i % every]

    def check(self, where=""):
        for a, s, tag in self.items:
            if sha(a) != s:
                self.errors.append(f"kept array {tag} changed (checked at {where})")
        return not self.errors


ZERO_ERRORS = []


def check_zero(a, tag=""):
    if np.any(a):
        ZERO_ERRORS.append(f"zeros not zero: {tag} shape={a.shape} dtype={a.dtype} nnz={np.count_nonzero(a)}")


def vmhwm_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1])


def report(hasher, kept=None, extra=None, wss=()):
    out = {
        "mode": MODE,
        "hash": hasher.hexdigest(),
        "nhash": hasher.n,
        "summ": hasher.summ,
        "hwm_kb": vmhwm_kb(),
        "zero_errors": ZERO_ERRORS[:5],
        "kept_errors": (kept.errors[:5] if kept else []),
    }
    if extra:
        out.update(extra)
    if CAPTURED:
        st = []
        for w in wss:
            try:
                s = w.stats()
                st.append(
                    {
                        k: getattr(s, k)
                        for k in (
                            "cycles",
                            "capacity_bytes",
                            "spill_count",
                            "pinned_bytes",
                            "external_bytes",
                            "failed_allocations",
                        )
                    }
                )
            except Exception as e:
                st.append(repr(e))
        out["stats"] = st
    print("RESULT " + json.dumps(out))
