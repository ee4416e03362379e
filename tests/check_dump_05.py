"""Independent check of lesson 05's --dump (DeepSeek-V3's MoE layer on expert-parallel ranks)
with numpy in float64: the affinities, the group-limited selection, the capacity assignment,
the gates, y, the sequence-wise balance loss and every gradient of L = sum(y * dy) + aux are
recomputed from the dumped x, dy, router_w, bias, experts_w1/w3/w2 and shared_w1/w3/w2, and
must match the dumped topk_idx, kept, gates, y, aux_loss, dx, d_router_w, d_experts_w1/w3/w2
and d_shared_w1/w3/w2; meta.json must describe the run. The backward is written out by hand.

The math (common/layers/dsv3_moe.h), written out again here rather than imported:
  z = x W_g (no logit bias);  s = sigmoid(z)  (gate softmax: s = softmax(z) over the N);
  biased = s + b, b the balancing bias (selection only, no gradient)
  selection: the N experts in G contiguous groups of N/G; a group's score is the sum of its
    gk = min(group_score_topk, N/G) largest biased values; a token keeps its top M groups,
    then its top K experts inside them, descending by biased (ties: the lower index)
  capacity (C > 0): cap = ceil(C T K / N) over all T tokens of all ranks, slot sl = t K + j.
    An expert chosen by more than cap slots keeps the cap slots of highest s_t,e (ties: the
    earlier slot); the rest overflow. drop: an overflow slot is dropped. next-best: in
    increasing sl, an overflow slot moves to its token's expert of highest biased (ties: the
    lower index) inside the token's kept groups, not among its current K, with load < cap;
    with none, it is dropped. A dropped slot keeps its expert in topk_idx, kept = 0.
  gates on the final idx, over all K slots (dropped ones too):
    sigmoid g_tj = rs s_t,idx_tj / (sum_j' s_t,idx_tj' + 1e-20);  softmax g_tj = rs s_t,idx_tj
  y_t = sum_{j kept} g_tj E_idx_tj(x_t) + H(x_t),  E(u) = (silu(u W1) * (u W3)) W2, H the same
    SwiGLU with the fused (d, S f) shared weights (no H when S = 0)
  aux = alpha * mean over sequences q of L tokens of sum_i f_qi P_qi,
    f_qi = N / (K L) #{t in q : i in the top K of t's unbiased s} (a constant; with meta.json's
    aux_count "selected": i in t's selection before capacity),
    P_qi = (1/L) sum_{t in q} s_ti / sum_j s_tj

Decisions taken on float32 values (the C++) and on float64 ones (here) may differ where two
compared values lie within the float32 rounding: at such a near-tie the dump's decision is
accepted when it is one the tolerance allows (a valid selection, a valid capacity cut, a valid
next-best expert), like check_dump_03 accepts a valid top-k; every other decision must be the
one recomputed here, and the final topk_idx and kept must equal the dumped ones.

usage: check_dump_05.py DIR [DIR2]
  DIR2: the same run with the other --a2a. Both are checked, then their inputs and routing
  (topk_idx, kept, gates) must be byte-identical and y, aux, dx and the gradients must agree
  within the tolerances used against numpy."""
import json
import math
import os
import sys

import numpy as np

EPS = float(np.finfo(np.float32).eps)
INPUTS = ("x", "dy", "router_w", "bias", "experts_w1", "experts_w3", "experts_w2",
          "shared_w1", "shared_w3", "shared_w2")
ROUTING = ("topk_idx", "kept", "gates")
GRADS = ("dx", "d_router_w", "d_experts_w1", "d_experts_w3", "d_experts_w2",
         "d_shared_w1", "d_shared_w3", "d_shared_w2")
sigmoid = lambda a: 1 / (1 + np.exp(-a))


def swiglu(u, w1, w3, w2):
    """E(u) = (silu(u W1) * (u W3)) W2, and what its backward needs."""
    a, b = u @ w1, u @ w3
    sg = sigmoid(a)
    h = a * sg * b
    return h @ w2, (a, b, sg, h)


def swiglu_backward(u, w1, w3, w2, saved, dout):
    """Gradients of sum(E(u) * dout): du, dW1, dW3, dW2."""
    a, b, sg, h = saved
    dh = dout @ w2.T
    da = dh * b * sg * (1 + a * (1 - sg))  # silu'(a) = sg (1 + a (1 - sg))
    db = dh * a * sg
    return da @ w1.T + db @ w3.T, u.T @ da, u.T @ db, h.T @ dout


def check_dump(d):
    """Checks one dump against numpy; returns what the comparison of two dumps needs."""
    meta = json.load(open(f"{d}/meta.json"))
    load = lambda name: np.load(f"{d}/{name}.npy")
    f64 = lambda name: load(name).astype(np.float64)
    has = lambda name: os.path.exists(f"{d}/{name}.npy")

    # ---- meta.json and shapes
    for key in ("gate", "N", "K", "S", "G", "M", "group_score_topk", "route_scale", "alpha",
                "capacity_factor", "overflow", "seq_len", "d", "f", "P", "a2a",
                "ranks_per_node", "residual"):
        assert key in meta, f"{d}: meta.json has no {key!r}: {meta}"
    gate, over = meta["gate"], meta["overflow"]
    N, K, S, G, M = (int(meta[k]) for k in ("N", "K", "S", "G", "M"))
    rs, alpha, C = float(meta["route_scale"]), float(meta["alpha"]), float(meta["capacity_factor"])
    assert gate in ("sigmoid", "softmax"), f"{d}: meta.json gate {gate!r}"
    assert over in ("drop", "next-best"), f"{d}: meta.json overflow {over!r}"
    assert meta["a2a"] in ("flat", "hierarchical"), f"{d}: meta.json a2a {meta['a2a']!r}"
    assert meta["residual"] is False, \
        f"{d}: meta.json residual {meta['residual']!r}: this check knows the layer without one"
    assert C >= 0, f"{d}: capacity_factor {C}"
    assert G >= 1 and N % G == 0 and 1 <= M <= G, f"{d}: N={N} G={G} M={M}"
    per = N // G
    assert 1 <= K <= M * per, f"{d}: K={K} is more than the {M * per} experts of M={M} groups"
    gk = min(int(meta["group_score_topk"]), per)
    assert gk >= 1, f"{d}: group_score_topk {meta['group_score_topk']}"

    x3, dy3 = f64("x"), f64("dy")
    B, L, D = x3.shape
    T = B * L
    x, dy = x3.reshape(T, D), dy3.reshape(T, D)
    Wg, bias = f64("router_w"), f64("bias")
    W1, W3, W2 = f64("experts_w1"), f64("experts_w3"), f64("experts_w2")
    F = W1.shape[2]
    assert (meta["d"], meta["f"], meta["seq_len"]) == (D, F, L), \
        f"{d}: meta.json d={meta['d']} f={meta['f']} seq_len={meta['seq_len']}, " \
        f"dumps say d={D} f={F} L={L} (x is {x3.shape})"
    P, R = int(meta["P"]), int(meta["ranks_per_node"])
    assert P >= 1 and B % P == 0, f"{d}: {B} sequences do not split evenly over P={P} ranks"
    assert R >= 1 and P % R == 0, f"{d}: ranks_per_node {R} does not divide P={P}"
    assert dy3.shape == x3.shape, f"{d}: dy {dy3.shape} vs x {x3.shape}"
    assert Wg.shape == (D, N) and bias.shape == (N,), f"{d}: router_w {Wg.shape}, bias {bias.shape}"
    assert W1.shape == W3.shape == (N, D, F) and W2.shape == (N, F, D), \
        f"{d}: experts_w1/w3 {W1.shape} {W3.shape}, w2 {W2.shape}, expected ({N}, {D}, {F})"
    shared_names = [n for n in INPUTS + GRADS if "shared" in n]
    present = [n for n in shared_names if has(n)]
    if S == 0:
        assert not present, f"{d}: S = 0 but the dump has {present}"
    else:
        assert len(present) == len(shared_names), \
            f"{d}: S = {S} but {sorted(set(shared_names) - set(present))} are missing"
        Ws1, Ws3, Ws2 = f64("shared_w1"), f64("shared_w3"), f64("shared_w2")
        assert Ws1.shape == Ws3.shape == (D, S * F) and Ws2.shape == (S * F, D), \
            f"{d}: shared weights {Ws1.shape} {Ws3.shape} {Ws2.shape}, S f = {S * F}"
    for name in ROUTING + ("y",) + GRADS + ("aux_loss",) + INPUTS:
        if name in shared_names and S == 0:
            continue
        dt = load(name).dtype
        want = np.int64 if name in ("topk_idx", "kept") else np.float32
        assert dt == want, f"{d}: {name} has dtype {dt}, expected {np.dtype(want)}"
    idx_d3, kept_d3 = load("topk_idx"), load("kept")
    assert idx_d3.shape == kept_d3.shape == (B, L, K), \
        f"{d}: topk_idx {idx_d3.shape}, kept {kept_d3.shape}, expected ({B}, {L}, {K})"
    idx_d, kept_d = idx_d3.reshape(T, K), kept_d3.reshape(T, K)
    assert idx_d.min() >= 0 and idx_d.max() < N, f"{d}: topk_idx outside [0, {N})"
    assert np.isin(kept_d, (0, 1)).all(), f"{d}: kept holds values other than 0 and 1"
    dup = [t for t in range(T) if len(set(idx_d[t].tolist())) < K]
    assert not dup, f"{d}: token {dup[0]} has the same expert twice in topk_idx: {idx_d[dup[0]]}"

    # ---- affinities, and the rounding the C++'s float32 ones carry
    z = x @ Wg
    if gate == "sigmoid":
        s = sigmoid(z)
    else:
        e = np.exp(z - z.max(1, keepdims=True))
        s = e / e.sum(1, keepdims=True)
    biased = s + bias
    # z in float32 is a D-term dot product: within D eps sum_i |x_i W_ie| (4x margin, as
    # check_dump_03). Relative error of s: sigmoid' = s (1 - s) <= s, so z_tol plus 2 eps for
    # the exp and the division; a softmax entry moves by at most 2 max|dz| relative, plus
    # N + 2 eps for its sum and division. Absolute (for the near-ties): sigmoid' <= 1/4; s <= 1.
    z_tol = 4 * (D + 1) * EPS * max(1.0, (np.abs(x) @ np.abs(Wg)).max())
    rel_s = z_tol + 2 * EPS if gate == "sigmoid" else 2 * z_tol + (N + 2) * EPS
    s_tol = z_tol / 4 + 2 * EPS if gate == "sigmoid" else rel_s
    b_tol = s_tol + EPS * (1 + np.abs(bias).max())  # s + b rounds once more
    # two compared values each within b_tol (s_tol) of the exact ones: a gap under twice that
    # may be ordered either way in float32. A group score sums gk such values in float32:
    # gk b_tol, plus gk roundings of partial sums of at most gk max|biased|.
    tie_e, tie_s = 2 * b_tol, 2 * s_tol
    tie_g = 2 * gk * (b_tol + gk * EPS * max(1.0, np.abs(biased).max()))

    # ---- the router's selection in float64, with its margins
    gscore = -np.sort(-biased.reshape(T, G, per), axis=2)[:, :, :gk].sum(2)  # (T, G)
    gorder = np.argsort(-gscore, axis=1, kind="stable")                     # ties: lower group
    in_kept = np.zeros((T, G), bool)
    np.put_along_axis(in_kept, gorder[:, :M], True, 1)
    allowed = np.repeat(in_kept, per, axis=1)                                # (T, N)
    masked = np.where(allowed, biased, -np.inf)
    eorder = np.argsort(-masked, axis=1, kind="stable")                      # ties: lower expert
    sel = eorder[:, :K].copy()
    kept_groups = [set(row) for row in gorder[:, :M].tolist()]
    vals = np.take_along_axis(masked, eorder, 1)
    gs_sorted = np.take_along_axis(gscore, gorder, 1)
    margin_g = gs_sorted[:, M - 1] - gs_sorted[:, M] if M < G else np.full(T, np.inf)
    margin_e = np.full(T, np.inf)
    if K > 1:
        margin_e = np.minimum(margin_e, (vals[:, :K - 1] - vals[:, 1:K]).min(1))
    if K < M * per:
        margin_e = np.minimum(margin_e, vals[:, K - 1] - vals[:, K])
    near_tie = (margin_g <= tie_g) | (margin_e <= tie_e)

    def valid_selection(t, row):
        """(kept groups, '') if `row` is a selection for token t within the rounding, else
        (None, why not)."""
        rg = sorted({int(e) // per for e in row})
        if len(rg) > M:
            return None, f"its experts span {len(rg)} groups, more than M={M}"
        others = [int(g) for g in gorder[t] if g not in rg]
        kg, out = rg + others[:M - len(rg)], others[M - len(rg):]
        if out and gscore[t, kg].min() < gscore[t, out].max() - tie_g:
            return None, (f"group scores {np.round(gscore[t], 6).tolist()}: a group outside "
                          f"its groups {kg} scores higher by more than {tie_g:.2e}")
        v = biased[t, list(row)]
        cand = [e for g in kg for e in range(g * per, (g + 1) * per) if e not in row]
        if cand and v.min() < biased[t, cand].max() - tie_e:
            return None, f"an unchosen expert of its groups has biased higher by more than {tie_e:.2e}"
        if K > 1 and np.diff(v).max() > tie_e:
            return None, f"biased {np.round(v, 6).tolist()} not descending within {tie_e:.2e}"
        return set(kg), ""

    # At a near-tie, the dump's row is the selection when it is a valid one (with capacity
    # next-best a row with a moved slot is not, and then float64's stays).
    ties_taken = 0
    for t in np.nonzero(near_tie)[0]:
        if (idx_d[t] != sel[t]).any():
            kg, _ = valid_selection(t, idx_d[t])
            if kg is not None:
                sel[t], kept_groups[t] = idx_d[t], kg
                ties_taken += 1

    # ---- capacity: the assignment from this selection
    slots = T * K
    cap = math.ceil(C * slots / N) if C > 0 else slots
    a_idx, a_kept = sel.reshape(-1).copy(), np.ones(slots, np.int64)
    load_ = np.zeros(N, np.int64)
    overflow, cut_margin, nb_note = [], {}, {}
    for ex in range(N):
        mine = np.nonzero(a_idx == ex)[0]  # increasing slot order
        if len(mine) > cap:
            se = s[mine // K, ex]
            keep = set(mine[np.argsort(-se, kind="stable")[:cap]].tolist())  # ties: earlier slot
            dkeep = {int(q) for q in mine if idx_d.flat[q] == ex and kept_d.flat[q]}
            rest = [int(q) for q in mine if q not in dkeep]
            if dkeep != keep and len(dkeep) == cap and \
                    s[[q // K for q in dkeep], ex].min() >= s[[q // K for q in rest], ex].max() - tie_s:
                keep = dkeep  # the cut falls inside a near-tie of s: the dump's cut is valid
                ties_taken += 1
            cut = np.sort(se)[::-1]
            cut_margin[ex] = (len(mine), cut[cap - 1] - cut[cap])
            overflow += [int(q) for q in mine if q not in keep]
        load_[ex] = min(len(mine), cap)
    moved = 0
    for q in sorted(overflow):  # global slot order
        t = q // K
        best = -1
        if over == "next-best":
            row = set(a_idx[t * K:(t + 1) * K].tolist())
            cand = [e for g in sorted(kept_groups[t]) for e in range(g * per, (g + 1) * per)
                    if load_[e] < cap and e not in row]
            nb_note[q] = {e: round(float(biased[t, e]), 6) for e in cand}
            if cand:
                best = min(cand, key=lambda e: (-biased[t, e], e))
                de = int(idx_d.flat[q])
                if kept_d.flat[q] and de != best and de in cand and \
                        biased[t, de] >= biased[t, best] - tie_e:
                    best = de  # a near-tie of biased: the dump's next-best is valid
                    ties_taken += 1
        if best < 0:
            a_kept[q] = 0
        else:
            a_idx[q], moved = best, moved + 1
            load_[best] += 1
    idx, kept = a_idx.reshape(T, K), a_kept.reshape(T, K)
    bad = np.nonzero((idx != idx_d) | (kept != kept_d))
    if bad[0].size:
        t, j = int(bad[0][0]), int(bad[1][0])
        why = (f"token {t}'s selection has a near-tie (group margin {margin_g[t]:.2e} vs "
               f"{tie_g:.2e}, expert margin {margin_e[t]:.2e} vs {tie_e:.2e}) that float32 may "
               f"decide otherwise, and the dumped row is not a valid selection: "
               f"{valid_selection(t, idx_d[t])[1] or 'it holds a moved slot'}"
               if near_tie[t] else
               f"token {t}'s selection has no near-tie (margins {margin_g[t]:.2e}, "
               f"{margin_e[t]:.2e} above the rounding {tie_g:.2e}, {tie_e:.2e})")
        e0, q = int(sel[t, j]), t * K + j
        if e0 in cut_margin:
            why += (f"; its selected expert {e0} is over capacity ({cut_margin[e0][0]} slots > "
                    f"cap {cap}): the s of its last kept and first overflowing slots differ by "
                    f"{cut_margin[e0][1]:.2e}, " +
                    ("a near-tie" if cut_margin[e0][1] <= tie_s else "not a near-tie") +
                    f" (rounding {tie_s:.2e})")
        if q in nb_note:
            why += (f"; it overflowed, next-best candidates with room (biased) {nb_note[q]}, "
                    f"near-tie rounding {tie_e:.2e}")
        raise AssertionError(
            f"{d}: the routing differs from the recomputed one at {bad[0].size} slots, first "
            f"token {t} slot {j}: dumped (expert, kept) = ({idx_d[t, j]}, {kept_d[t, j]}), "
            f"numpy ({idx[t, j]}, {kept[t, j]}); dumped row {idx_d[t].tolist()} kept "
            f"{kept_d[t].tolist()}, selection here {sel[t].tolist()}, assignment here "
            f"{idx[t].tolist()} kept {kept[t].tolist()} (C={C:g}, cap={cap}, {over}). "
            f"{why}")
    loads = np.bincount(idx_d[kept_d == 1], minlength=N)
    assert loads.max() <= cap, f"{d}: expert loads {loads.tolist()} exceed cap {cap}"
    if C == 0:
        assert kept_d.all(), f"{d}: no capacity limit, yet slots were dropped"
    dropped = int(slots - kept.sum())

    # ---- gates, experts, y
    s_sel = np.take_along_axis(s, idx, 1)
    if gate == "sigmoid":
        Ssum = s_sel.sum(1, keepdims=True) + 1e-20
        g = rs * s_sel / Ssum
    else:
        g = rs * s_sel
    y = np.zeros_like(x)
    dx = np.zeros_like(x)
    dW1, dW3, dW2 = np.zeros_like(W1), np.zeros_like(W3), np.zeros_like(W2)
    dg = np.zeros((T, K))  # dL/dg: 0 on dropped slots
    out_max = 0.0
    for ex in range(N):
        tok, j = np.nonzero((idx == ex) & (kept == 1))
        if tok.size == 0:
            continue
        out, saved = swiglu(x[tok], W1[ex], W3[ex], W2[ex])
        out_max = max(out_max, np.abs(out).max())
        np.add.at(y, tok, g[tok, j][:, None] * out)
        dg[tok, j] = (dy[tok] * out).sum(1)
        dxe, dW1[ex], dW3[ex], dW2[ex] = swiglu_backward(
            x[tok], W1[ex], W3[ex], W2[ex], saved, g[tok, j][:, None] * dy[tok])
        np.add.at(dx, tok, dxe)
    if S > 0:
        hs, saved = swiglu(x, Ws1, Ws3, Ws2)
        y += hs
        dxs, dWs1, dWs3, dWs2 = swiglu_backward(x, Ws1, Ws3, Ws2, saved, dy)  # ungated
        dx += dxs

    # ---- the balance loss: f counts each token's top-K of the unbiased s (the report's eq. 18),
    # or with aux_count "selected" the selection before capacity
    nseq = B
    sn = s / s.sum(1, keepdims=True)                                  # s' = s / Z
    cnt = np.zeros((nseq, N))
    assert meta["aux_count"] in ("unbiased-topk", "selected"), f"{d}: aux_count {meta['aux_count']!r}"
    counted = sel if meta["aux_count"] == "selected" else np.argsort(-s, axis=1, kind="stable")[:, :K]
    np.add.at(cnt, (np.repeat(np.arange(T) // L, K), counted.reshape(-1)), 1.0)
    fq = N / (K * L) * cnt                                            # (B, N)
    Pq = sn.reshape(nseq, L, N).mean(1)
    aux = alpha * (fq * Pq).sum(1).mean()

    # ---- the router's backward: ds (T, N), then dz, dW_g, dx
    ds = np.zeros((T, N))
    if gate == "sigmoid":
        # g_j = rs s_j / Ssum: d g_j / d s_m = rs (delta_jm / Ssum - s_j / Ssum^2)
        ds_sel = rs * dg / Ssum - (dg * g).sum(1, keepdims=True) / Ssum
    else:
        ds_sel = rs * dg
    np.add.at(ds, (np.repeat(np.arange(T), K), idx.reshape(-1)), ds_sel.reshape(-1))
    w = alpha / (nseq * L) * np.repeat(fq, L, axis=0)                 # d aux / d s'_ti
    ds += (w - (w * sn).sum(1, keepdims=True)) / s.sum(1, keepdims=True)
    if gate == "sigmoid":
        dz = ds * s * (1 - s)
    else:
        dz = s * (ds - (ds * s).sum(1, keepdims=True))
    dWg = x.T @ dz
    dx += dz @ Wg.T

    # ---- compare. Tolerances, float32 results against float64 math:
    # gates: s_j / Ssum carries 2 rel_s (s_j, and Ssum, a sum of positive s), and K + 3 eps
    #   for the sum, the division and route_scale: (2 rel_s + (K + 3) eps) |g|, per entry.
    # y: K gated expert outputs and the shared one, each a chain of D-, F- and S F-term float32
    #   dot products: 4 (D + F + S F + K + 1) eps max|y|, plus K gate errors times max|E|.
    # gradients: every entry is a float32 sum of at most n_terms terms, 4 n_terms eps max|ref|
    #   (the lesson's own tolerance), plus 4 rel_s max|ref|: the gates (2 rel_s) scale every
    #   path, and the router's path multiplies by s (1 - s) or the softmax Jacobian (2 rel_s).
    # aux: a positive sum of f P, P a mean of s' = s / Z with Z a positive sum: relative
    #   2 rel_s, plus N + 3 eps for Z's sum, the division and the float32 result.
    n_terms = T * K + D + F * max(S, 1) + N
    mx = lambda a: max(np.abs(a).max() if a.size else 0.0, 1e-3)
    g_tol = (2 * rel_s + (K + 3) * EPS) * np.abs(g)
    tols = {"gates": g_tol,
            "y": 4 * (D + F + S * F + K + 1) * EPS * mx(y) + K * g_tol.max() * out_max,
            "aux_loss": (2 * rel_s + (N + 3) * EPS) * max(abs(aux), 1e-30)}
    refs = {"gates": (g, (B, L, K)), "y": (y, x3.shape), "dx": (dx, x3.shape),
            "d_router_w": (dWg, None), "d_experts_w1": (dW1, None), "d_experts_w3": (dW3, None),
            "d_experts_w2": (dW2, None)}
    if S > 0:
        refs.update({"d_shared_w1": (dWs1, None), "d_shared_w3": (dWs3, None),
                     "d_shared_w2": (dWs2, None)})
    for name in refs:
        if name not in tols:
            tols[name] = (4 * n_terms * EPS + 4 * rel_s) * mx(refs[name][0])
    ratios = {}
    for name, (ref, shape) in refs.items():
        got = load(name)
        want_shape = shape or ref.shape
        assert got.shape == want_shape, f"{d}: {name} has shape {got.shape}, expected {want_shape}"
        assert np.isfinite(got).all(), f"{d}: {name} has NaN or inf"
        err = np.abs(got.astype(np.float64).reshape(ref.shape) - ref)
        ratio = err / np.maximum(tols[name], 1e-300)  # a tolerance per entry, or one for all
        w_ = np.unravel_index(ratio.argmax(), ratio.shape)
        assert ratio[w_] <= 1, \
            f"{d}: {name} differs from numpy at {tuple(int(i) for i in w_)}: dumped " \
            f"{got.reshape(ref.shape)[w_]:.8g}, numpy {ref[w_]:.8g}, error {err[w_]:.3e} > " \
            f"tol {np.broadcast_to(tols[name], ref.shape)[w_]:.3e} (max abs error {err.max():.3e})"
        ratios[name] = ratio[w_]
    got_aux = float(load("aux_loss"))
    assert load("aux_loss").shape == (), f"{d}: aux_loss has shape {load('aux_loss').shape}"
    assert abs(got_aux - aux) <= tols["aux_loss"], \
        f"{d}: aux_loss {got_aux:.8g} vs numpy {aux:.8g} (tol {tols['aux_loss']:.2e})"
    ratios["aux_loss"] = abs(got_aux - aux) / tols["aux_loss"]
    # experts with no kept slot: a gradient of exactly 0
    empty = np.nonzero(np.bincount(idx[kept == 1], minlength=N) == 0)[0]
    for name in ("d_experts_w1", "d_experts_w3", "d_experts_w2"):
        assert (load(name)[empty] == 0).all(), \
            f"{d}: {name}: experts {empty.tolist()} have no kept slot but a nonzero gradient"

    worst = max(ratios, key=ratios.get)
    print(f"dump ok: {d}: {T} tokens (B={B} x L={L}), d={D} f={F} N={N} K={K} S={S} G={G} M={M} "
          f"gk={gk}, gate {gate}, C={C:g} {over} (cap {cap}: {dropped} dropped, {moved} moved), "
          f"P={P} {meta['a2a']}, aux {aux:.6g}, {ties_taken} near-ties decided as the "
          f"dump did, {len(empty)} empty experts; worst error/tolerance {ratios[worst]:.3f} ({worst})")
    return meta, {n: load(n) for n in INPUTS + ROUTING if has(n)}, \
        {n: load(n) for n in ("y", "aux_loss") + GRADS if has(n)}, tols


if len(sys.argv) not in (2, 3):
    sys.exit("usage: check_dump_05.py DIR [DIR2]")
results = [check_dump(d) for d in sys.argv[1:]]
if len(results) == 2:
    (m1, ex1, out1, tols), (m2, ex2, out2, _) = results
    d1, d2 = sys.argv[1:]
    diff = sorted(k for k in set(m1) | set(m2) if k != "a2a" and m1.get(k) != m2.get(k))
    assert not diff, f"{d1} and {d2} are not the same run: meta.json differs in {diff}"
    assert m1["a2a"] != m2["a2a"], f"{d1} and {d2} both used --a2a {m1['a2a']}"
    assert ex1.keys() == ex2.keys() and out1.keys() == out2.keys(), \
        f"{d1} and {d2} hold different files"
    for name in ex1:  # inputs, and the routing: decided identically before any all-to-all
        a, b = ex1[name], ex2[name]
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), \
            f"{name} is not byte-identical between {d1} and {d2}" + \
            (f" ({np.count_nonzero(a != b)} entries differ)" if a.shape == b.shape else "")
    # y, aux, dx and the gradients: the two all-to-alls sum in different orders. Each dump is
    # within its tolerance of the float64 result; their difference must be within it too.
    ratios = {}
    for name in out1:
        err = float(np.abs(out1[name].astype(np.float64) - out2[name].astype(np.float64)).max())
        tol = tols[name]
        assert err <= tol, f"{name}: {d1} and {d2} differ by {err:.3e} > tol {tol:.3e}"
        ratios[name] = err / tol
    worst = max(ratios, key=ratios.get)
    same = sum(out1[n].tobytes() == out2[n].tobytes() for n in out1)
    print(f"dumps ok: {m1['a2a']} and {m2['a2a']} agree: inputs and routing (topk_idx, kept, "
          f"gates) byte-identical, {same} of {len(out1)} outputs bitwise equal, worst "
          f"difference/tolerance {ratios[worst]:.3g} ({worst})")
