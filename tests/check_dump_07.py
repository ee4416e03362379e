"""Independent check of lesson 07's --dump with numpy in float64: the loss and the gradient of
every layer's parameters are recomputed from the dumped parameters, inputs and targets, with a
backward written out by hand here, and must match what the pipeline produced (for DualPipe, the
sum of a stage's two copies). meta.json must describe the run.

The model (lessons/07_dualpipe/main.cpp), written out again here rather than imported:
  block l:  n = rmsnorm(x) * g_l,  y = x + silu(n W1_l) W2_l,  rmsnorm(x) = x / sqrt(mean(x^2) + eps)
  loss = (1/M) sum over micro-batches of mean((y - target)^2) = sum((y - t)^2) / (M rows dim)
Every micro-batch goes through the same blocks and the loss is a sum over rows, so the whole
batch is one (M rows, dim) matrix here.

usage: check_dump_07.py DIR"""
import json
import sys

import numpy as np

if len(sys.argv) != 2:
    sys.exit("usage: check_dump_07.py DIR")
d = sys.argv[1]
meta = json.load(open(f"{d}/meta.json"))
f64 = lambda name: np.load(f"{d}/{name}.npy").astype(np.float64)
L, M, rows, D, eps = meta["layers"], meta["M"], meta["rows"], meta["dim"], meta["eps"]

x, t = f64("x"), f64("target")
assert x.shape == (M * rows, D) and t.shape == x.shape, (x.shape, t.shape)
params = [(f64(f"layer{l}_g"), f64(f"layer{l}_w1"), f64(f"layer{l}_w2")) for l in range(L)]

# forward, keeping what the backward needs
sig = lambda a: 1.0 / (1.0 + np.exp(-a))
saved, h = [], x
for g, w1, w2 in params:
    rms = np.sqrt((h * h).mean(axis=1, keepdims=True) + eps)
    n = h / rms * g
    a = n @ w1
    s = a * sig(a)
    saved.append((h, rms, n, a, s))
    h = h + s @ w2
loss = ((h - t) ** 2).sum() / (M * rows * D)

# backward
grads = [None] * L
dy = 2.0 * (h - t) / (M * rows * D)
for l in reversed(range(L)):
    g, w1, w2 = params[l]
    hin, rms, n, a, s = saved[l]
    dw2 = s.T @ dy
    ds = dy @ w2.T
    da = ds * (sig(a) + a * sig(a) * (1.0 - sig(a)))
    dw1 = n.T @ da
    dn = da @ w1.T
    dg = (dn * hin / rms).sum(axis=0)
    u = dn * g  # d(x / rms)
    dx_norm = u / rms - hin * (u * hin).sum(axis=1, keepdims=True) / (D * rms**3)
    grads[l] = (dg, dw1, dw2)
    dy = dy + dx_norm

worst = 0.0
def close(name, got, want):
    global worst
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
    worst = max(worst, err)
    if not err < 1e-4:
        sys.exit(f"dump MISMATCH: {name}: max error {err:.2e} of its largest value")

close("loss", f64("loss"), loss)
for l in range(L):
    for k, name in enumerate(["dg", "dw1", "dw2"]):
        close(f"layer {l} {name}", f64(f"layer{l}_{name}"), grads[l][k])
print(f"dump ok: {meta['schedule']} P={meta['P']} M={M}, loss and the gradients of {L} layers "
      f"match numpy float64 (worst {worst:.1e} of the largest value, tol 1e-4)")
