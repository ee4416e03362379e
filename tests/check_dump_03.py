"""Independent check of lesson 03's --dump (and lesson 04's, which writes the same files with x
the concatenation of the ranks' batches) with numpy in float64: the router, the gates, y, the
load-balance loss and every gradient of L = sum(y * dy) + aux are recomputed from the dumped
x, dy, router_w, router_b, experts_w1/w3/w2 and must match the dumped y, topk_val, aux_loss,
dx, d_router_w, d_router_b, d_experts_w1/w2/w3. The routing is the dumped topk_idx (a ranking
recomputed in float64 could differ from float32's at a near-tie), checked to be a valid top-k
of the recomputed scores; meta.json must describe the run.

The math (common/layers/moe.h), written out again here rather than imported:
  z = x W_g + b,  p = softmax(z) over all N;  softmax-topk: g = p[idx];  topk-softmax:
  g = softmax(z[idx]);  y_t = sum_j g_tj E_idx_tj(x_t),  E(u) = (silu(u W1) * (u W3)) W2;
  aux = alpha N sum_i f_i P_i,  f_i = count_i / (k T) (a constant),  P_i = mean_t p_ti.

usage: check_dump_03.py DIR"""
import json
import sys

import numpy as np

if len(sys.argv) != 2:
    sys.exit("usage: check_dump_03.py DIR")
d = sys.argv[1]
meta = json.load(open(f"{d}/meta.json"))
load = lambda name: np.load(f"{d}/{name}.npy")
f64 = lambda name: load(name).astype(np.float64)

x3, dy3 = f64("x"), f64("dy")
B, S, D = x3.shape
x, dy = x3.reshape(-1, D), dy3.reshape(-1, D)
T = x.shape[0]
Wg, bg = f64("router_w"), f64("router_b")
W1, W3, W2 = f64("experts_w1"), f64("experts_w3"), f64("experts_w2")
N, F = W1.shape[0], W1.shape[2]
k, alpha, gate = int(meta["k"]), float(meta["alpha"]), meta["gate"]
idx3 = load("topk_idx")

# ---- shapes and meta.json
assert gate in ("softmax-topk", "topk-softmax"), f"meta.json gate {gate!r}"
assert (meta["N"], meta["d"], meta["f"]) == (N, D, F), \
    f"meta.json {meta} vs weights N={N} d={D} f={F}"
assert dy3.shape == x3.shape, f"dy {dy3.shape} vs x {x3.shape}"
assert Wg.shape == (D, N) and bg.shape == (N,), f"router_w {Wg.shape}, router_b {bg.shape}"
assert W1.shape == W3.shape == (N, D, F) and W2.shape == (N, F, D), "expert weight shapes"
assert idx3.dtype == np.int64 and idx3.shape == (B, S, k), f"topk_idx {idx3.dtype} {idx3.shape}"
assert 1 <= k <= N, f"k={k}, N={N}"
idx = idx3.reshape(T, k)
assert idx.min() >= 0 and idx.max() < N, "topk_idx out of range"
assert all(len(set(row)) == k for row in idx.tolist()), "a token picked the same expert twice"

eps = np.finfo(np.float32).eps
n_terms = T * k + D + F + N  # the longest float32 sum behind any gradient entry


def check(name, got, ref, tol, shape=None):
    assert got.dtype == np.float32, f"{name}: dtype {got.dtype}"
    want_shape = shape or ref.shape
    assert got.shape == want_shape, f"{name}: shape {got.shape}, expected {want_shape}"
    err = np.abs(got.astype(np.float64).reshape(ref.shape) - ref).max() if ref.size else 0.0
    assert err <= tol, f"{name} differs from numpy: max abs {err:.3e} > tol {tol:.3e}"
    return err / tol  # how much of its tolerance the comparison used


# ---- router: the dumped routing must be a top-k of the recomputed scores, in order
z = x @ Wg + bg
zmax = z.max(-1, keepdims=True)
p = np.exp(z - zmax)
p /= p.sum(-1, keepdims=True)
# z in float32 is a sum of D products and the bias: within (D + 1) eps of the terms' size.
# Both gates rank by z (softmax is monotone), so a valid top-k has every chosen logit at least
# the largest unchosen one, and the chosen ones descending — up to that rounding.
z_tol = 4 * (D + 1) * eps * max(1.0, (np.abs(x) @ np.abs(Wg) + np.abs(bg)).max())
chosen = np.take_along_axis(z, idx, 1)
unchosen = z.copy()
np.put_along_axis(unchosen, idx, -np.inf, 1)
if k < N:
    assert (chosen.min(1) >= unchosen.max(1) - z_tol).all(), \
        "topk_idx is not the top-k of the recomputed router logits"
assert (np.diff(chosen, axis=1) <= z_tol).all(), "topk_idx is not sorted by descending score"

if gate == "softmax-topk":
    g = np.take_along_axis(p, idx, 1)
else:
    e = np.exp(chosen - chosen.max(1, keepdims=True))
    g = e / e.sum(1, keepdims=True)
# a softmax over at most N values: a few eps relative, values <= 1
ratio_g = check("topk_val", load("topk_val"), g, 8 * N * eps, (B, S, k))

# ---- experts and y, one expert at a time over the tokens that chose it
silu = lambda a: a / (1 + np.exp(-a))
y = np.zeros_like(x)
dx = np.zeros_like(x)
dW1, dW3, dW2 = np.zeros_like(W1), np.zeros_like(W3), np.zeros_like(W2)
dg = np.zeros((T, k))
for ex in range(N):
    tok, j = np.nonzero(idx == ex)  # the slots (token, choice) of expert ex
    if tok.size == 0:
        continue  # no tokens: no output, and dW of exactly 0 (checked below)
    xe = x[tok]
    a, b = xe @ W1[ex], xe @ W3[ex]
    s = 1 / (1 + np.exp(-a))
    h = a * s * b
    out = h @ W2[ex]                              # E_ex(x_t) for these slots
    np.add.at(y, tok, g[tok, j][:, None] * out)
    # backward: L = sum(y * dy) -> upstream of this slot's expert output is g * dy_t
    dg[tok, j] = (dy[tok] * out).sum(1)
    dout = g[tok, j][:, None] * dy[tok]
    dW2[ex] = h.T @ dout
    dh = dout @ W2[ex].T
    da = dh * b * s * (1 + a * (1 - s))           # silu'(a) = s (1 + a (1 - s))
    db = dh * a * s
    dW1[ex], dW3[ex] = xe.T @ da, xe.T @ db
    np.add.at(dx, tok, da @ W1[ex].T + db @ W3[ex].T)

# ---- the load-balance loss and the router's gradient
count = np.bincount(idx.ravel(), minlength=N).astype(np.float64)
f = count / (k * T)
P = p.mean(0)
aux = alpha * N * (f * P).sum()
dp = np.broadcast_to(alpha * N * f / T, (T, N)).copy()  # d aux / d p_ti, f held constant
if gate == "softmax-topk":
    np.add.at(dp, (np.repeat(np.arange(T), k), idx.ravel()), dg.ravel())  # g_tj = p_t[idx_tj]
    dz = p * (dp - (dp * p).sum(1, keepdims=True))
else:
    dz = p * (dp - (dp * p).sum(1, keepdims=True))     # aux through the full softmax
    dzk = g * (dg - (dg * g).sum(1, keepdims=True))    # gates: softmax of the chosen logits
    np.add.at(dz, (np.repeat(np.arange(T), k), idx.ravel()), dzk.ravel())
dWg = x.T @ dz
dbg = dz.sum(0)
dx += dz @ Wg.T

# ---- compare. float32 results against float64 math: y is a sum of k gated expert outputs,
# each a chain of D- and F-term dot products: 4 (D + F + k) eps times its largest value. Every
# gradient entry is a float32 sum of at most n_terms terms: 4 n_terms eps times the largest
# value (the lesson's own tolerance). aux: N float32 sums of T probabilities, 8 n_terms eps.
tol = lambda ref, n: 4 * n * eps * max(np.abs(ref).max() if ref.size else 0.0, 1e-3)
ratios = {"topk_val": ratio_g}
ratios["y"] = check("y", load("y"), y, tol(y, D + F + k), x3.shape)
got_aux = float(load("aux_loss"))
aux_tol = 8 * n_terms * eps * max(aux, 1e-3)
assert abs(got_aux - aux) <= aux_tol, \
    f"aux_loss {got_aux:.8g} vs numpy {aux:.8g} (tol {aux_tol:.2e})"
ratios["aux_loss"] = abs(got_aux - aux) / aux_tol
for name, ref, shape in [("dx", dx, x3.shape), ("d_router_w", dWg, None), ("d_router_b", dbg, None),
                         ("d_experts_w1", dW1, None), ("d_experts_w3", dW3, None),
                         ("d_experts_w2", dW2, None)]:
    ratios[name] = check(name, load(name), ref, tol(ref, n_terms), shape)
# experts nobody chose: exactly zero, no NaN
empty = np.nonzero(count == 0)[0]
for name in ("d_experts_w1", "d_experts_w3", "d_experts_w2"):
    got = load(name)
    assert np.isfinite(got).all(), f"{name} has NaN or inf"
    assert (got[empty] == 0).all(), \
        f"{name}: experts {empty.tolist()} got no tokens but a nonzero gradient"

worst = max(ratios, key=ratios.get)
print(f"dump ok: {T} tokens (B={B} x T={S}), d={D} f={F} N={N} k={k}, gate {gate}, "
      f"alpha {alpha:g}, P={meta.get('P', 1)}, aux {aux:.6g}, {len(empty)} empty experts; "
      f"worst error/tolerance {ratios[worst]:.3f} ({worst})")
