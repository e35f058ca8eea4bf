"""Two threads, each with its own workspace: standardise + PCA (SVD) + ridge solve on batches
of (n, 64) and (n+1, 64); each thread keeps its per-batch coefficients."""

import threading

import numpy as np
from common import Hasher, Kept, check_zero, report, ws
from sklearn.decomposition import PCA
from sklearn.linear_model import Ridge
from sklearn.preprocessing import StandardScaler

rng = np.random.default_rng(7)
X_all = rng.standard_normal((40_001, 64))
y_all = X_all @ rng.standard_normal(64) + 0.1 * rng.standard_normal(40_001)
out = {}
kept = {}
errors = []


def worker(tid):
    W = ws(f"thr{tid}")
    H, K = Hasher(), Kept()
    try:
        for step in range(30):
            n = (4096, 4097, 32_768, 32_769, 12_000)[(step + tid) % 5]
            with W:
                X = X_all[:n] * (1 + tid)
                y = y_all[:n]
                Xs = StandardScaler().fit_transform(X)
                P = PCA(n_components=16, svd_solver="full").fit(Xs)
                T = P.transform(Xs)
                m = Ridge(alpha=1.0).fit(np.hstack([Xs, T[:, :4]]), y)
                res = y - m.predict(np.hstack([Xs, T[:, :4]]))
                z = np.zeros((n + 1, 64))
                check_zero(z, f"p07 t{tid} step={step}")
                H.add(np.round(P.explained_variance_ratio_, 10))
                H.add(np.round(m.coef_, 9))
                H.add(np.round(res[:50], 9))
                K.keep(m.coef_, f"t{tid} step={step}")
                K.keep(T[::100], f"t{tid} T step={step}")
            if step % 4 == 0:
                K.check(f"t{tid} {step}")
        K.drop_some()
        K.check("end")
    except Exception as e:  # report, do not hide
        errors.append(repr(e))
    out[tid] = H
    kept[tid] = (K, W)


ts = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
for t in ts:
    t.start()
for t in ts:
    t.join()
H = Hasher()
for t in range(2):
    H.h.update(out[t].hexdigest().encode())
    H.summ += out[t].summ
K = Kept()
for t in range(2):
    K.errors += kept[t][0].errors
report(H, K, extra={"thread_errors": errors}, wss=[kept[t][1] for t in range(2)])
