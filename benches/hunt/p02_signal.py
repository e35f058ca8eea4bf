"""Signal processing: np.pad, np.convolve full vs same, FFT of n and n+1, float32/float64 mix,
scipy.signal; `for i in ws.cycles(range(...))`, a loop variable living into the next cycle."""

import numpy as np
import scipy.signal as ss
from common import Hasher, Kept, check_zero, report, ws

W = ws("sig")
H, K = Hasher(), Kept()
rng = np.random.default_rng(2)
sig = rng.standard_normal(1_600_000)
k = np.hanning(65)
b, a = ss.butter(4, 0.1)
prev = None
for N in (16_385, 131_072, 786_431):
    for i in W.cycles(range(36)):
        n = N + (i % 4) - 1
        x = sig[:n].astype(np.float32)
        xp = np.pad(x, (1, 1), mode="reflect")
        full = np.convolve(xp, k, "full")
        same = np.convolve(x, k, "same")
        X = np.fft.rfft(x.astype(np.float64))
        X1 = np.fft.rfft(xp[: n + 1])
        y = np.fft.irfft(X, n)
        y1 = np.fft.irfft(X1, n + 1)
        filt = ss.lfilter(b, a, same)
        fc = ss.fftconvolve(x, k.astype(np.float32), mode="same")
        mix = same.astype(np.float32) + y[:n].astype(np.float32)
        if prev is not None:
            m = min(len(prev), n)
            H.add(prev[:m] - y[:m])
        zz = np.zeros((n + 1,), np.float32)
        check_zero(zz, f"p02 N={N} i={i}")
        for r in (full, same, X, y, y1, filt, fc, mix):
            H.add(r)
        prev = y if i % 2 else y1  # lives into the next cycle
        if i % 6 == 0:
            K.keep(mix, f"N={N} i={i}")
        K.check(f"N={N} i={i}")
    K.drop_some()
K.check("end")
report(H, K, wss=[W])
