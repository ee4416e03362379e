"""Golden data for the AdamW optimizer: torch.optim.AdamW's parameters after each of 5 steps,
which tests/unit/test_optim.cpp checks common/core/optim.h against.

What it writes, into the directory given as the only argument (float32 .npy files):

  adamw_p0, adamw_p1, adamw_p2     the initial parameters, shapes (4, 5), (7,), (2, 3, 3)
  adamw_g0, adamw_g1, adamw_g2     their gradients at steps 1..5, stacked: (5, 4, 5), ...
                                   gradient scales 1, 1e-3 and 100 (Adam is scale-free, so
                                   every parameter moves by ~lr a step); a few exact zeros
  adamw_decay_p0, ...              the parameters after steps 1..5, stacked: (5, 4, 5), ...,
                                   for lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight_decay 0.1
  adamw_nodecay_p0, ...            the same with weight_decay 0

The gradients are given, not computed: the optimizer is tested alone. Inputs are float32,
drawn by numpy from a fixed seed. As in ops.py, torch.optim.AdamW runs in float64 on those
exact float32 values and only the saved parameters are rounded to float32, so the goldens
carry no float32 error of their own; the script also runs AdamW in float32 and checks that
PyTorch's own float32 result lies within the tolerance the C++ test uses (printed).

Regenerate (needs Debian's python3-torch; the files are committed, a few KB each):

    /usr/bin/python3 tests/reference/adamw.py tests/reference/data

The output is deterministic: rerunning it rewrites the same bytes.
"""
import os
import sys

import numpy as np
import torch

SEED = 20240602
STEPS = 5
SHAPES = [(4, 5), (7,), (2, 3, 3)]
GRAD_SCALES = [1.0, 1e-3, 100.0]
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8
CASES = {"adamw_decay": 0.1, "adamw_nodecay": 0.0}
# The tolerance of tests/unit/test_optim.cpp (kAdamTol there says why): |got - want| <=
# ATOL + RTOL * |want| for every element.
ATOL, RTOL = 2e-7, 1e-6


def run_adamw(params, grads, weight_decay, dtype):
    """params[i] (shape), grads[i] (STEPS, shape), float32 numpy -> the parameters after each
    step, (STEPS, shape) in dtype."""
    ps = [torch.tensor(p, dtype=dtype) for p in params]
    opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay,
                            foreach=False)
    history = [[] for _ in ps]
    for step in range(STEPS):
        for p, g in zip(ps, grads):
            p.grad = torch.tensor(g[step], dtype=dtype)
        opt.step()
        for h, p in zip(history, ps):
            h.append(p.detach().clone())
    return [torch.stack(h).numpy() for h in history]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: adamw.py OUT_DIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    rng = np.random.default_rng(SEED)
    written = []

    def save(name, value):
        path = os.path.join(out, f"{name}.npy")
        np.save(path, np.asarray(value, dtype=np.float32))
        written.append(path)

    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads = [(rng.standard_normal((STEPS,) + s) * scale).astype(np.float32)
             for s, scale in zip(SHAPES, GRAD_SCALES)]
    grads[0][:, 0, 0] = 0.0  # a parameter whose gradient is always 0: m = v = 0, only decay
    grads[1][2, :3] = 0.0    # zeros at one step only
    for i, (p, g) in enumerate(zip(params, grads)):
        save(f"adamw_p{i}", p)
        save(f"adamw_g{i}", g)

    for case, wd in CASES.items():
        want = run_adamw(params, grads, wd, torch.float64)
        for i, w in enumerate(want):
            save(f"{case}_p{i}", w)
        # PyTorch's own float32 AdamW against the float64 answer, with the C++ test's bound
        got32 = run_adamw(params, grads, wd, torch.float32)
        for i, (g32, w) in enumerate(zip(got32, want)):
            err = np.abs(g32.astype(np.float64) - w)
            print(f"{case}_p{i}: torch float32 vs float64 max abs {err.max():.2e}, "
                  f"max of err / (atol + rtol |want|) {(err / (ATOL + RTOL * np.abs(w))).max():.2f}")
            assert (err <= ATOL + RTOL * np.abs(w)).all(), f"{case}_p{i}: float32 torch outside tol"

    total = sum(os.path.getsize(p) for p in written)
    print(f"wrote {len(written)} files, {total} bytes, to {out}")


if __name__ == "__main__":
    main()
