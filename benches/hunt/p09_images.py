"""Image batches of off-by-one shapes: float32/float64 conversion, 2-D np.pad, scipy.ndimage
filters, gradients, colour quantisation with scikit-learn's KMeans and pairwise distances;
`for img in ws.cycles(generator)`, thumbnails kept."""

import numpy as np
import scipy.ndimage as ndi
from common import Hasher, Kept, check_zero, report, ws
from sklearn.cluster import KMeans
from sklearn.metrics import pairwise_distances_argmin

W = ws("img")
H, K = Hasher(), Kept()
rng = np.random.default_rng(9)


def images():
    for i in range(30):
        h, w = ((255, 256), (256, 256), (256, 257), (511, 512), (512, 512), (720, 1281))[i % 6]
        yield i, (rng.random((h, w, 3)) * 255).astype(np.uint8)


thumbs = []
for i, img in W.cycles(images()):
    f = img.astype(np.float32) / 255.0
    d = img.astype(np.float64)
    p = np.pad(f, ((1, 1), (1, 1), (0, 0)), mode="edge")
    gray = p.mean(axis=2)
    sm = ndi.gaussian_filter(gray, 1.5)
    gx = np.diff(sm, axis=1, prepend=sm[:, :1])
    gy = np.diff(sm, axis=0, append=sm[-1:])
    mag = np.hypot(gx, gy)
    edges = mag > np.percentile(mag, 90)
    lab, nlab = ndi.label(edges)
    px = d.reshape(-1, 3)
    sample = px[::37]
    km = KMeans(n_clusters=6, n_init=1, random_state=0, max_iter=20).fit(sample)
    q = pairwise_distances_argmin(px[::3], km.cluster_centers_)
    z = np.zeros(gray.shape, np.float64)
    check_zero(z, f"p09 i={i}")
    H.add(sm)
    H.add(mag)
    H.add(edges)
    H.add(np.array([nlab]))
    H.add(np.round(km.cluster_centers_, 6))
    H.add(q)
    thumbs.append(sm[::8, ::8])
    K.keep(gy, f"i={i}")
    if i % 5 == 4:
        thumbs = thumbs[::2]
        K.drop_some()
        K.check(f"i={i}")
for t in thumbs:
    H.add(t)
K.check("end")
report(H, K, wss=[W])
