"""Independent check of lesson 08's --dump (the tiny DeepSeek-style model trained on a DP x TP
mesh) with numpy in float64: the validation loss is recomputed from the dumped weights (every
parameter and the MoE balancing biases, after training) and the dumped validation batch, and
must match val_loss, the loss the mesh computed in float32; meta.json must describe the run
and the dump must hold exactly the files of that model.

The model (common/layers/model.h, dsv3_moe.h; tests/reference/model.py), written out again
here rather than imported:
  x = embed[ids];  per layer  x += MLA(rmsnorm(x, attn_norm));  x += FFN(rmsnorm(x, ffn_norm))
  logits = rmsnorm(x, norm) head;  loss = mean over the B T tokens of -log softmax(logits)[target]
  rmsnorm(x, w) = x / sqrt(mean(x^2) + eps) * w, eps = norm_eps (a float32 value)
  rope(x) at position p: each consecutive pair (x[2i], x[2i+1]) of the last dim (D = d_rope)
    rotated by the angle p theta^(-2i/D) (DeepSeek-V3's apply_rotary_emb); positions 0..T-1
  MLA(u): c_q = rmsnorm(u W_dq, q_norm);  q = c_q W_uq per head [q_nope (d_nope) | q_pe (d_rope)],
    q_pe = rope(q_pe);  c_kv = rmsnorm(u W_dkv, kv_norm);  k_nope = c_kv W_uk, v = c_kv W_uv per
    head;  k_pe = rope(u W_kr), one per token shared by every head;
    scores = (q_nope . k_nope + q_pe . k_pe) / sqrt(d_nope + d_rope), causal, softmax over keys,
    o = p v, MLA(u) = o W_o
  FFN of the first dense_layers layers: (silu(u W1) * (u W3)) W2
  FFN of the others, DeepSeek-V3's MoE with one group, no capacity: s = sigmoid(u router_w);
    the K experts of largest s + bias (ties: the lower index); gates g_j = route_scale s_j /
    (sum of the K chosen s + 1e-20) (route_scale 1 unless meta.json says otherwise);
    y = sum_j g_j E_j(u) + H(u), E_e(u) = (silu(u W1_e) * (u W3_e)) W2_e, H the same SwiGLU with
    the fused (d, shared moe_ffn) shared weights (no H when shared = 0)

Tolerance: |loss_numpy - val_loss| <= 4 n eps max(1, |loss|), n = B T, eps = 2^-23 (float32's
machine epsilon): the lesson's own bound between the mesh and one process. As a first-order
worst case for float32 against exact arithmetic: the loss is the mean of n positive per-token
terms, and a float32 sum of them is within (n - 1) eps/2 |loss| of the exact sum; each term
carries the roundings of the sequential dot products and row sums on its token's path (per
layer rmsnorm d, W_dq d, rmsnorm r_q, W_uq r_q, scores d_nope + d_rope, softmax and p v T each,
W_o H d_v, rmsnorm d, W1 d, W2 f; then rmsnorm d, head d, logsumexp V), about 1400 terms at the
lesson's default sizes, so about 1400 eps/2 = 2.7 n eps relative at n = 256; the dumped
float32 adds eps/2. Both together stay under 4 n eps |loss|. Typical errors are far smaller
(random signs, no worst-case alignment): observed about 1e-4 of the bound, i.e. the dumped
loss is within a float32 ulp of float64's. The final line prints the observed |diff| / tol.

Routing is an integer decision: a token whose K-th and (K+1)-th largest s + bias differ by
less than MARGIN may be sent to other experts by the float32 mesh than by this recomputation,
and then the losses differ by more than rounding without any bug. Such near-ties are counted and named. When the loss is outside the tolerance and there
are at most MAX_FLIPS near-ties, every combination of swapping their K-th and (K+1)-th experts
is tried, and the dump passes when one of them matches (the swap is then reported); otherwise
the failure names the near-ties rather than only the difference. MARGIN = 1e-5, as in
tests/reference/model.py: this forward run in float32 numpy gives s + bias within 3e-7 of the
float64 one on the lesson's dumps, so a gap of 1e-5 cannot be reordered by float32 rounding.

The last training step is dumped too (last_step.*: the weights before it, its global batch, the
mesh's loss and mean gradients): its loss is recomputed the same way, and the gradients are
checked along a random direction against a float64 central difference (check_last_step).

usage: check_dump_08.py DIR
  prints one final line, "dump ok: ..." (exit 0) or "dump FAIL: ..." (exit 1)"""
import itertools
import json
import math
import os
import sys

import numpy as np

EPS = float(np.finfo(np.float32).eps)  # 2^-23
MARGIN = 1e-5
MAX_FLIPS = 8
META_KEYS = ("vocab", "dim", "layers", "dense_layers", "heads", "d_nope", "d_rope", "d_v",
             "q_lora", "kv_lora", "ffn", "experts", "topk", "shared", "moe_ffn", "seq",
             "rope_theta", "norm_eps", "mesh")


class Fail(Exception):
    """A check that did not hold; its text follows "dump FAIL: "."""


def require(cond, msg):
    if not cond:
        raise Fail(msg)


def expected_shapes(m):
    """model.h's named_parameters and named_buffers for this config: {name: shape}."""
    d, H, V = m["dim"], m["heads"], m["vocab"]
    N, f, S = m["experts"], m["moe_ffn"], m["shared"]
    shapes = {"embed": (V, d)}
    for i in range(m["layers"]):
        l = f"layers.{i}."
        shapes.update({
            l + "attn_norm": (d,), l + "attn.w_dq": (d, m["q_lora"]), l + "attn.q_norm": (m["q_lora"],),
            l + "attn.w_uq": (m["q_lora"], H * (m["d_nope"] + m["d_rope"])),
            l + "attn.w_dkv": (d, m["kv_lora"]), l + "attn.kv_norm": (m["kv_lora"],),
            l + "attn.w_uk": (m["kv_lora"], H * m["d_nope"]), l + "attn.w_uv": (m["kv_lora"], H * m["d_v"]),
            l + "attn.w_kr": (d, m["d_rope"]), l + "attn.w_o": (H * m["d_v"], d), l + "ffn_norm": (d,)})
        if i < m["dense_layers"]:
            shapes.update({l + "ffn.w1": (d, m["ffn"]), l + "ffn.w3": (d, m["ffn"]),
                           l + "ffn.w2": (m["ffn"], d)})
        else:
            shapes.update({l + "moe.router_w": (d, N), l + "moe.experts_w1": (N, d, f),
                           l + "moe.experts_w3": (N, d, f), l + "moe.experts_w2": (N, f, d),
                           l + "moe.bias": (N,)})
            if S > 0:
                shapes.update({l + "moe.shared_w1": (d, S * f), l + "moe.shared_w3": (d, S * f),
                               l + "moe.shared_w2": (S * f, d)})
    shapes.update({"norm": (d,), "head": (d, V)})
    return shapes


def sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def silu(a):
    return a * sigmoid(a)


def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, theta):
    """x (B, T, ..., D): pairs (2i, 2i + 1) of the last dim rotated by t theta^(-2i/D) at
    position t (the second axis)."""
    T, D = x.shape[1], x.shape[-1]
    inv_freq = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)         # (D/2)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]       # (T, D/2)
    ang = ang.reshape((1, T) + (1,) * (x.ndim - 3) + (D // 2,))
    c, s = np.cos(ang), np.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y = np.empty_like(x)
    y[..., 0::2] = x0 * c - x1 * s
    y[..., 1::2] = x0 * s + x1 * c
    return y


def mla(m, w, l, u):
    """u (B, T, d) -> (B, T, d)."""
    B, T, _ = u.shape
    H, dn, dr, dv, eps = m["heads"], m["d_nope"], m["d_rope"], m["d_v"], m["eps"]
    c_q = rmsnorm(u @ w[l + "attn.w_dq"], w[l + "attn.q_norm"], eps)
    q = (c_q @ w[l + "attn.w_uq"]).reshape(B, T, H, dn + dr)
    q_nope, q_pe = q[..., :dn], rope(q[..., dn:], m["theta"])
    c_kv = rmsnorm(u @ w[l + "attn.w_dkv"], w[l + "attn.kv_norm"], eps)
    k_nope = (c_kv @ w[l + "attn.w_uk"]).reshape(B, T, H, dn)
    v = (c_kv @ w[l + "attn.w_uv"]).reshape(B, T, H, dv)
    k_pe = rope(u @ w[l + "attn.w_kr"], m["theta"])                        # (B, T, d_rope)
    scores = (np.einsum("bshd,bthd->bhst", q_nope, k_nope) +
              np.einsum("bshr,btr->bhst", q_pe, k_pe)) / math.sqrt(dn + dr)
    scores = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, scores)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhst,bthd->bshd", p, v).reshape(B, T, H * dv)
    return o @ w[l + "attn.w_o"]


def swiglu(u, w1, w3, w2):
    return (silu(u @ w1) * (u @ w3)) @ w2


def moe(m, w, l, u, flip, fixed=None):
    """u (n, d) -> y (n, d), the routes (n, K) and the margins (n): each token's K-th largest
    s + bias minus its (K+1)-th (inf when K = N). Tokens in `flip` take their (K+1)-th expert
    instead of their K-th; `fixed` (n, K), when given, are the routes to take instead of the
    top-K (the derivative of the loss holds the routing still: top-K has no gradient)."""
    N, K = m["experts"], m["topk"]
    s = sigmoid(u @ w[l + "moe.router_w"])
    biased = s + w[l + "moe.bias"]
    order = np.argsort(-biased, axis=1, kind="stable")                       # ties: lower index
    idx = order[:, :K].copy()
    vals = np.take_along_axis(biased, order, 1)
    margin = vals[:, K - 1] - vals[:, K] if K < N else np.full(len(u), np.inf)
    for t in flip:
        idx[t, K - 1] = order[t, K]
    if fixed is not None:
        idx = fixed
    s_sel = np.take_along_axis(s, idx, 1)
    g = m["route_scale"] * s_sel / (s_sel.sum(1, keepdims=True) + 1e-20)
    y = np.zeros_like(u)
    for e in range(N):
        tok, j = np.nonzero(idx == e)
        if tok.size:
            out = swiglu(u[tok], w[l + "moe.experts_w1"][e], w[l + "moe.experts_w3"][e],
                         w[l + "moe.experts_w2"][e])
            np.add.at(y, tok, g[tok, j][:, None] * out)
    if m["shared"] > 0:
        y += swiglu(u, w[l + "moe.shared_w1"], w[l + "moe.shared_w3"], w[l + "moe.shared_w2"])
    return y, idx, margin


def model_loss(m, w, inputs, targets, flips=frozenset(), routes=None):
    """The mean cross-entropy, and per MoE layer (layer, routes (B T, K), margins (B T)).
    flips: (layer, token) pairs routed to their (K+1)-th expert instead of their K-th.
    routes: a previous call's routing, to route every MoE layer the same way again."""
    fixed = {i: idx for i, idx, _ in routes} if routes is not None else {}
    B, T = inputs.shape
    d, eps = m["dim"], m["eps"]
    x = w["embed"][inputs]                                                  # (B, T, d)
    routing = []
    for i in range(m["layers"]):
        l = f"layers.{i}."
        x = x + mla(m, w, l, rmsnorm(x, w[l + "attn_norm"], eps))
        u = rmsnorm(x, w[l + "ffn_norm"], eps)
        if i < m["dense_layers"]:
            x = x + swiglu(u, w[l + "ffn.w1"], w[l + "ffn.w3"], w[l + "ffn.w2"])
        else:
            y, idx, margin = moe(m, w, l, u.reshape(B * T, d), [t for (li, t) in flips if li == i],
                                 fixed.get(i))
            x = x + y.reshape(B, T, d)
            routing.append((i, idx, margin))
    logits = (rmsnorm(x, w["norm"], eps) @ w["head"]).reshape(B * T, -1)
    mx = logits.max(1, keepdims=True)
    lse = np.log(np.exp(logits - mx).sum(1)) + mx[:, 0]
    loss = (lse - logits[np.arange(B * T), targets.reshape(-1)]).mean()
    return loss, routing


def check(d):
    """Returns the "dump ok" line; raises Fail (or an I/O error) otherwise."""
    require(os.path.isdir(d), f"{d} is not a directory")
    require(os.path.isfile(f"{d}/meta.json"), f"{d} has no meta.json")
    meta = json.load(open(f"{d}/meta.json"))
    missing = [k for k in META_KEYS if k not in meta]
    require(not missing, f"{d}/meta.json lacks {missing}: {meta}")
    m = {k: int(meta[k]) for k in META_KEYS if k not in ("rope_theta", "norm_eps", "mesh")}
    # the C++ holds theta and eps as floats: the same float32 values here, in float64
    m["theta"] = float(np.float32(meta["rope_theta"]))
    m["eps"] = float(np.float32(meta["norm_eps"]))
    m["route_scale"] = float(meta.get("route_scale", 1.0))
    require(all(m[k] > 0 for k in ("vocab", "dim", "layers", "heads", "d_nope", "d_rope", "d_v",
                                   "q_lora", "kv_lora", "ffn", "seq")),
            f"{d}/meta.json has a size <= 0: {meta}")
    require(0 <= m["dense_layers"] <= m["layers"], f"{d}/meta.json dense_layers {m['dense_layers']} "
            f"outside [0, layers = {m['layers']}]")
    require(m["d_rope"] % 2 == 0, f"{d}/meta.json d_rope {m['d_rope']} is odd")
    has_moe = m["dense_layers"] < m["layers"]
    if has_moe:
        require(m["experts"] > 0 and m["moe_ffn"] > 0 and 1 <= m["topk"] <= m["experts"]
                and m["shared"] >= 0, f"{d}/meta.json MoE settings out of range: {meta}")

    # ---- the files: exactly the model's parameters and buffers, the batch and the loss
    shapes = expected_shapes(m)
    want = {n + ".npy" for n in shapes} | {"val_inputs.npy", "val_targets.npy", "val_loss.npy",
                                           "meta.json"}
    params = [n for n in shapes if not n.endswith(".moe.bias")]
    last = {f"last_step.{n}.npy" for n in shapes} | {f"last_step.grad.{n}.npy" for n in params} | \
        {"last_step.inputs.npy", "last_step.targets.npy", "last_step.loss.npy"}
    want |= last
    files = set(os.listdir(d))
    require(files == want, f"{d}: missing {sorted(want - files)}, unexpected {sorted(files - want)}")
    w = {}
    for name, shape in shapes.items():
        a = np.load(f"{d}/{name}.npy")
        require(a.dtype == np.float32 and a.shape == shape,
                f"{name}.npy is {a.dtype} {a.shape}, the model's {name} is float32 {shape}")
        require(np.isfinite(a).all(), f"{name}.npy holds NaN or inf")
        w[name] = a.astype(np.float64)
    inputs, targets = np.load(f"{d}/val_inputs.npy"), np.load(f"{d}/val_targets.npy")
    val = np.load(f"{d}/val_loss.npy")
    require(inputs.dtype == targets.dtype == np.int64,
            f"val_inputs {inputs.dtype} and val_targets {targets.dtype} must be int64")
    require(inputs.ndim == 2 and inputs.shape == targets.shape and inputs.shape[1] == m["seq"],
            f"val_inputs {inputs.shape}, val_targets {targets.shape}, expected (B, seq = {m['seq']})")
    require(inputs.min() >= 0 and inputs.max() < m["vocab"] and targets.min() >= 0
            and targets.max() < m["vocab"], f"the validation tokens are outside [0, {m['vocab']})")
    # inputs and targets are the first and the last T of the same T + 1 tokens
    require((inputs[:, 1:] == targets[:, :-1]).all(),
            "val_targets is not val_inputs shifted by one token")
    require(val.dtype == np.float32 and val.shape == (),
            f"val_loss.npy is {val.dtype} {val.shape}, expected a 0-d float32")
    got = float(val)
    require(math.isfinite(got), f"val_loss is {got}")

    # ---- the loss, and the routing margins
    B, T = inputs.shape
    n = B * T
    loss, routing = model_loss(m, w, inputs, targets)
    tol = 4 * n * EPS * max(1.0, abs(loss))
    near = [(i, int(t), float(mg[t])) for i, _, mg in routing for t in np.nonzero(mg < MARGIN)[0]]
    min_margin = min((float(mg.min()) for _, _, mg in routing), default=math.inf)
    diff = abs(loss - got)
    note = ""
    if not diff <= tol and 0 < len(near) <= MAX_FLIPS:
        # float32 may have decided a near-tie the other way: try every combination
        pairs = [(i, t) for i, t, _ in near]
        for k in range(1, len(pairs) + 1):
            for combo in itertools.combinations(pairs, k):
                alt, _ = model_loss(m, w, inputs, targets, frozenset(combo))
                if abs(alt - got) <= tol:
                    note = (f", matched with {k} near-tie token(s) sent to their (K+1)-th expert "
                            f"{list(combo)} (float64's routing gives {loss:.6f})")
                    loss, diff = alt, abs(alt - got)
                    break
            if note:
                break
    if not diff <= tol:
        why = ""
        if near:
            shown = ", ".join(f"layer {i} token {t} margin {mg:.1e}" for i, t, mg in near[:6])
            why = (f"; {len(near)} token(s) have a top-{m['topk']} routing margin below {MARGIN:g} "
                   f"({shown}{', ...' if len(near) > 6 else ''}): the float32 mesh may route them "
                   f"to other experts" +
                   (", yet no combination of swaps matches" if len(near) <= MAX_FLIPS else
                    f", too many to try every swap (> {MAX_FLIPS})"))
        elif routing:
            why = f"; no routing near-tie (smallest margin {min_margin:.1e} >= {MARGIN:g})"
        raise Fail(f"{d}: loss {loss:.6f} (numpy float64) vs {got:.6f} (mesh), |diff| {diff:.2e} > "
                   f"tol {tol:.2e} (4 n eps max(1, |loss|), n = {n}){why}")
    tie_text = ""
    if routing:
        tie_text = (f", {len(routing)} MoE layer(s), smallest routing margin {min_margin:.1e}" +
                    (f" ({len(near)} below {MARGIN:g})" if near else ""))
    grad_text = check_last_step(d, m, shapes, params)
    return (f"dump ok: loss {loss:.6f} (numpy float64) vs {got:.6f} (mesh {meta['mesh']}), "
            f"|diff| {diff:.1e} <= tol {tol:.1e} ({diff / tol:.2g} of it; n = B T = {B} x {T}), "
            f"{grad_text}, {len(files)} files{tie_text}{note}")


def check_last_step(d, m, shapes, params):
    """The last training step as the mesh ran it: the weights before it (last_step.<name>), the
    global batch, the mesh's loss and its mean gradient of every weight (last_step.grad.<name>).
    The loss is recomputed as above. Each weight's gradient is checked along a random direction u
    of its own (seeded): the central difference (L(w + h u) - L(w - h u)) / 2h of the float64
    forward against <grad, u>. h = 1e-6 keeps the difference's truncation (h^2) and rounding
    (1e-16 / h) errors near 1e-10, and moves no routing decision whose margin exceeds about
    h |u|, and the +-h runs take the unperturbed run's routes anyway (the derivative holds the
    top-K still, as the mesh's does); the tolerance is the gradient check's own,
    4 n eps sum |grad u|, plus the difference's rounding."""
    w = {}
    for name, shape in shapes.items():
        a = np.load(f"{d}/last_step.{name}.npy")
        require(a.dtype == np.float32 and a.shape == shape, f"last_step.{name}.npy is {a.dtype} {a.shape}")
        w[name] = a.astype(np.float64)
    g = {}
    for name in params:
        a = np.load(f"{d}/last_step.grad.{name}.npy")
        require(a.dtype == np.float32 and a.shape == shapes[name] and np.isfinite(a).all(),
                f"last_step.grad.{name}.npy is {a.dtype} {a.shape} or not finite")
        g[name] = a.astype(np.float64)
    inputs, targets = np.load(f"{d}/last_step.inputs.npy"), np.load(f"{d}/last_step.targets.npy")
    require((inputs[:, 1:] == targets[:, :-1]).all(), "last_step.targets is not last_step.inputs shifted")
    got = float(np.load(f"{d}/last_step.loss.npy"))
    n = inputs.size
    loss, routing = model_loss(m, w, inputs, targets)
    tol = 4 * n * EPS * max(1.0, abs(loss))
    require(abs(loss - got) <= tol, f"last step: loss {loss:.6f} (numpy float64) vs {got:.6f} (mesh), "
            f"|diff| {abs(loss - got):.2e} > tol {tol:.2e}")
    rng = np.random.default_rng(8)
    h = 1e-6
    worst, worst_name = 0.0, ""
    for k in params:  # one direction per weight tensor: a wrong gradient cannot hide in the sum
        uk = rng.standard_normal(shapes[k])
        plus, minus = dict(w), dict(w)
        plus[k], minus[k] = w[k] + h * uk, w[k] - h * uk
        # the same routes at w +- h u: the derivative the mesh computed holds the top-K still
        numeric = (model_loss(m, plus, inputs, targets, routes=routing)[0] -
                   model_loss(m, minus, inputs, targets, routes=routing)[0]) / (2 * h)
        analytic = float((g[k] * uk).sum())
        # + the central difference's own rounding, about 1e-16 |L| / h, a thousand times over
        gtol = 4 * n * EPS * float(np.abs(g[k] * uk).sum()) + 1e-8 * abs(numeric) + \
            1e3 * 2.2e-16 * abs(loss) / h
        require(abs(numeric - analytic) <= gtol,
                f"last step: {k}'s gradient along a random direction gives {analytic:.6e}, the "
                f"float64 central difference {numeric:.6e}, |diff| {abs(numeric - analytic):.2e} > "
                f"tol {gtol:.2e} (4 n eps sum |grad u|)")
        if abs(numeric - analytic) / gtol >= worst:
            worst, worst_name = abs(numeric - analytic) / gtol, k
    return (f"last step's {len(params)} gradients along random directions = float64 central "
            f"differences (worst {worst:.2g} of the tolerance, {worst_name})")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: check_dump_08.py DIR")
    try:
        line = check(sys.argv[1])
    except (Fail, OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"dump FAIL: {e}")
        sys.exit(1)
    print(line)


if __name__ == "__main__":
    main()
