"""Independent check of lesson 02's --dump with numpy (float64): attention forward and
backward recomputed from the dumped q, k, v, do must match the dumped o, lse, dq, dk, dv
(gathered from the ranks, in token order), and meta.json must describe the run.
usage: check_dump_02.py DIR P"""
import json
import sys

import numpy as np

d, P = sys.argv[1], int(sys.argv[2])
meta = json.load(open(f"{d}/meta.json"))
assert meta["P"] == P, f"meta.json says P={meta['P']}, the run had {P}"
load = lambda name: np.load(f"{d}/{name}.npy")
q, k, v, do = (load(n).astype(np.float64) for n in ("q", "k", "v", "do"))
B, H, S, D = q.shape
assert k.shape == v.shape == do.shape == (B, H, S, D)
assert abs(meta["scale"] - 1 / np.sqrt(D)) < 1e-6

s = np.einsum("bhid,bhjd->bhij", q, k) * meta["scale"]
if meta["causal"]:
    s = np.where(np.triu(np.ones((S, S), bool), 1), -np.inf, s)
m = s.max(-1, keepdims=True)
lse = m + np.log(np.exp(s - m).sum(-1, keepdims=True))
p = np.exp(s - lse)
o = p @ v
dv = np.swapaxes(p, -1, -2) @ do
dp = do @ np.swapaxes(v, -1, -2)
ds = p * (dp - (do * o).sum(-1, keepdims=True))
dq = ds @ k * meta["scale"]
dk = np.swapaxes(ds, -1, -2) @ q * meta["scale"]

# float32 results against float64 math: the dumped tensors went through float32 sums of at
# most S + D terms; bound each by (S + D) * eps32 times the largest term magnitude.
eps = np.finfo(np.float32).eps
for name, ref, mag in [("o", o, np.abs(v).max()), ("lse", lse[..., 0], 1 + np.abs(lse).max()),
                       ("dq", dq, D * np.abs(do).max() * np.abs(v).max() * np.abs(k).max()),
                       ("dk", dk, D * np.abs(do).max() * np.abs(v).max() * np.abs(q).max()),
                       ("dv", dv, np.abs(do).max())]:
    got = load(name)
    assert got.dtype == np.float32 and got.shape == ref.shape, f"{name}: {got.dtype} {got.shape}"
    tol = 4 * (S + D) * eps * mag
    err = np.abs(got - ref).max()
    assert err <= tol, f"{name} differs from numpy: max abs {err:.3e} > tol {tol:.3e}"
print(f"dump ok: B={B} H={H} S={S} D={D}, causal={meta['causal']}, layout {meta['layout']}, P={P}")
