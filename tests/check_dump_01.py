"""Independent check of lesson 01's --dump with numpy (float64): softmax(x) and
softmax(q k^T / sqrt(d)) v recomputed from the dumped inputs must match the dumped
outputs, and the per-rank (m, l) must merge into the row's true max and normaliser.
usage: check_dump_01.py DIR P"""
import sys

import numpy as np

d, P = sys.argv[1], int(sys.argv[2])
x = np.load(f"{d}/x.npy").astype(np.float64)
assert x.dtype == np.float64 and x.ndim == 2
m = x.max(axis=1, keepdims=True)
ref = np.exp(x - m) / np.exp(x - m).sum(axis=1, keepdims=True)
got = np.load(f"{d}/softmax.npy")
# float32 outputs against float64 math: a few ulps of float32 per element, scaled by the row
# length for the normaliser's summation (n * eps / 2 relative), absolute floor for subnormals.
n = x.shape[1]
tol = n * np.finfo(np.float32).eps / 2
assert np.allclose(got, ref, rtol=tol, atol=1e-30), f"softmax differs: {np.abs(got - ref).max()}"

# (m, l) of each rank merge into the global (max, sum exp(x - max)) of each row
ms, ls = [], []
for r in range(P):
    ml = np.load(f"{d}/ml_rank{r}.npy").astype(np.float64)
    ms.append(ml[:, 0]); ls.append(ml[:, 1])
M = np.max(ms, axis=0)
L = sum(np.where(np.isinf(mr), 0.0, lr * np.exp(mr - M)) for mr, lr in zip(ms, ls))
assert np.allclose(M, m[:, 0]), "merged max differs"
assert np.allclose(L, np.exp(x - m).sum(axis=1), rtol=tol), "merged normaliser differs"

q, k, v = (np.load(f"{d}/{t}.npy").astype(np.float64) for t in "qkv")
s = q @ k.T / np.sqrt(q.shape[1])
p = np.exp(s - s.max(axis=1, keepdims=True))
attn = (p / p.sum(axis=1, keepdims=True)) @ v
got = np.load(f"{d}/attention.npy")
tol_o = k.shape[0] * np.finfo(np.float32).eps / 2
assert np.allclose(got, attn, rtol=tol_o, atol=tol_o * np.abs(v).max()), \
    f"attention differs: {np.abs(got - attn).max()}"
print(f"dump ok: softmax {x.shape}, {P} ranks' (m, l), attention {attn.shape}")
