"""Golden data for the DeepSeek-V3 MoE layer (common/layers/dsv3_moe.h, lesson 05): PyTorch's
answers that tests/unit/test_dsv3_moe.cpp checks the C++ layer against.

The layer, written here from DeepSeek-V3's inference/model.py (Gate and MoE) and its technical
report (arXiv 2412.19437, section 2.1.2 and 2.3), not from the C++:

  s = sigmoid(x router_w)  or  softmax(x router_w)        affinities (T, N), "original_scores"
  selection on s + bias (bias: no gradient): the N experts in G contiguous groups, a group's
      score = the sum of its topk(group_score_topk) biased affinities (each case names its
      group_score_topk); keep the top M groups (masked_fill -inf for the others), then
      idx = topk(K) of what is left, descending
  capacity (capacity_factor C > 0): cap = ceil(C T K / N) slots per expert; an expert chosen
      by more slots keeps the cap with the highest unbiased s[t, e] (ties: earlier slot
      t K + j); the rest overflow and are handled in global slot order:
        drop       the slot is dropped (contributes 0)
        next-best  the slot moves to its token's best expert by s + b inside the token's kept
                   groups, not among its current K, with load < cap (that load + 1); with
                   none, it is dropped (it keeps its first choice)
  gates from the unbiased s of the final experts (dropped slots included in the sum):
      sigmoid: g = route_scale * s[idx] / (sum_K s[idx] + 1e-20);  softmax: route_scale * s[idx]
  routed experts E_e(u) = (silu(u W1_e) * (u W3_e)) W2_e, run densely on every token here and
      gathered; y_t = sum over kept slots of g_tj E_idx_tj(x_t)
  shared experts: S SwiGLUs fused into one of width S f, ungated, added to y
  balance loss (sequence-wise, report eq. 17-20): per sequence of L tokens,
      f_i = N / (K L) * #{t : i in the top-K of t's unbiased affinities s}  (the report's
      eq. 18: no bias, no group limit; a constant), P_i = mean_t s_ti / sum_j s_tj;  L_bal = alpha * mean over sequences of
      sum_i f_i P_i
  loss = sum(y * dy) + L_bal; autograd gives the gradient of every weight and of x.

Cases (T = 24 tokens = 3 sequences of L = 8, d = 6, f = 5, N = 8, K = 2):

  case               gate     G  M  gtk  S  alpha  route_scale  capacity  overflow
  sigmoid_groups     sigmoid  4  2  2    1  0.3    2.5          -         -
  softmax            softmax  1  1  2    2  0.3    1.5          -         -
  capacity_drop      sigmoid  2  1  2    1  0.3    2.5          0.75      drop
  capacity_next_best sigmoid  2  1  2    1  0.3    2.5          0.75      next-best

(gtk = group_score_topk; in the capacity cases a group has 4 experts, so its score is the sum
of its 2 best, not of all 4.) cap = ceil(0.75 * 24 * 2 / 8) = 5: 8 experts hold at most 40 of
the 48 slots, so both capacity cases drop slots, and next-best also moves some (asserted).

What it writes, into the directory given as the only argument, dsv3_<case>_<name>.npy:
  config       float32 (12): gate (0 sigmoid, 1 softmax), N, K, G, M, group_score_topk, S,
               alpha, route_scale, capacity_factor, overflow (0 drop, 1 next-best), L
  inputs       x (T, d), dy (T, d), router_w (d, N), bias (N), experts_w1, experts_w3 (N, d, f),
               experts_w2 (N, f, d), shared_w1, shared_w3 (d, S f), shared_w2 (S f, d)
  routing      sel_idx (T, K) int64: the router's top-K before capacity; kept_groups (T, M)
               int64; idx (T, K) int64: the final experts; kept (T, K) int64 0/1;
               load (N) int64: slots each expert finally processes; gates (T, K)
  outputs      y (T, d), balance (), dx, d_router_w, d_experts_w1, d_experts_w3, d_experts_w2,
               d_shared_w1, d_shared_w3, d_shared_w2

and, for the check that seed 003's load_balance_sequence_wise is not the report's loss (on
case sigmoid_groups' s and selection), dsv3_seed003_<name>.npy:
  balance_paper   alpha * mean_q sum_i f_qi P_qi   (= dsv3_sigmoid_groups_balance)
  balance_skip_k0 the seed's loop, `for k in range(bs): fi = Nr / (k * seq_len) * count_k;
                  pi = (s_k / s_k.sum(-1)).sum(0) / seq_len; l_bal += (fi * pi).sum() / seq_len`,
                  evaluated with s_k, count_k = sequence k's affinities (L, N) and top-K counts
                  (the seed does not slice them by k; this is its evident intent), over
                  k = 1 .. bs - 1 only, times alpha. So term k is (K / k) (sum_i f_ki P_ki) / L:
                  the loop variable k shadows top-K and replaces it, and 1 / L replaces 1 / bs.
  balance_k0_term the k = 0 term alone in float64 arithmetic: N / 0 = inf, times the counts
                  (0 * inf = NaN for an expert sequence 0 never picked): not finite. (In the
                  seed's literal Python, `Nr / (k * seq_len)` with ints raises
                  ZeroDivisionError at k = 0.)

Inputs are float32, drawn by numpy from a fixed seed; the C++ test loads them from the files.
The math runs in float64 on those exact float32 values and only results are rounded to
float32. The draws are repeated until every routing decision (group choice and order, the
top-K and its order, the capacity cut, each next-best choice) is decided by a margin of at
least MARGIN in the float64 affinities: the C++ layer's float32 ones are within ~1e-6, so its
integer routing must equal this one exactly. The script also asserts that the bias changes at
least one token's selection in case sigmoid_groups.

Regenerate (needs Debian's python3-torch; the files are committed, a few KB in all):

    /usr/bin/python3 tests/reference/dsv3_moe.py tests/reference/data    (part of make reference)

The output is deterministic: rerunning it rewrites the same bytes.
"""
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

SEED = 20240605
T, L, D, FFN, N, K = 24, 8, 6, 5, 8, 2
BIAS_SPREAD = 0.05
MARGIN = 1e-4

CASES = [
    # name, gate, G, M, group_score_topk, S, alpha, route_scale, capacity_factor, overflow
    ("sigmoid_groups", "sigmoid", 4, 2, 2, 1, 0.3, 2.5, 0.0, "drop"),
    ("softmax", "softmax", 1, 1, 2, 2, 0.3, 1.5, 0.0, "drop"),
    ("capacity_drop", "sigmoid", 2, 1, 2, 1, 0.3, 2.5, 0.75, "drop"),
    ("capacity_next_best", "sigmoid", 2, 1, 2, 1, 0.3, 2.5, 0.75, "next-best"),
]


class Case:
    def __init__(self, name, gate, G, M, gtk, S, alpha, route_scale, capacity, overflow):
        self.name, self.gate, self.G, self.M, self.gtk, self.S = name, gate, G, M, gtk, S
        self.alpha, self.route_scale = alpha, route_scale
        self.capacity, self.overflow = capacity, overflow


def affinities(c, x, router_w):
    z = x @ router_w
    return torch.sigmoid(z) if c.gate == "sigmoid" else torch.softmax(z, dim=-1)


def gate_select(c, s, bias):
    """inference/model.py's Gate.forward selection on s + bias. Returns idx (T, K) descending,
    kept_groups (T, M) descending, and the minimum margin of every decision made."""
    scores = s + bias
    margin = math.inf
    if c.G > 1:
        grouped = scores.view(T, c.G, -1)
        group_scores = grouped.topk(min(c.gtk, N // c.G), dim=-1)[0].sum(dim=-1)  # (T, G)
        sorted_g = group_scores.sort(dim=-1, descending=True)[0]
        m = min(c.M + 1, c.G)
        margin = min(margin, (sorted_g[:, :m - 1] - sorted_g[:, 1:m]).min().item())
        kept_groups = group_scores.topk(c.M, dim=-1)[1]
        mask = torch.ones(T, c.G, dtype=torch.bool).scatter_(1, kept_groups, False)
        scores = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
    else:
        kept_groups = torch.zeros(T, 1, dtype=torch.int64)
    top = scores.sort(dim=-1, descending=True)[0][:, :min(K + 1, c.M * (N // c.G))]
    margin = min(margin, (top[:, :-1] - top[:, 1:]).min().item())
    idx = torch.topk(scores, K, dim=-1)[1]
    return idx, kept_groups, margin


def apply_capacity(c, s, bias, idx, kept_groups):
    """Capacity over the T K slots (slot = t K + j). s, bias float64 numpy, idx/kept_groups int
    numpy. Returns final idx, kept (0/1), load per expert, counts and the decisions' margin."""
    final = idx.copy()
    kept = np.ones((T, K), dtype=np.int64)
    cap = math.ceil(c.capacity * T * K / N) if c.capacity > 0 else T * K
    margin = math.inf
    overflow = []
    load = np.zeros(N, dtype=np.int64)
    for e in range(N):
        slots = [sl for sl in range(T * K) if idx[sl // K, sl % K] == e]
        # highest s[t, e] first, ties to the earlier slot (Python's sort is stable)
        slots.sort(key=lambda sl: -s[sl // K, e])
        if len(slots) > cap:
            margin = min(margin, s[slots[cap - 1] // K, e] - s[slots[cap] // K, e])
            overflow += slots[cap:]
        load[e] = min(len(slots), cap)
    moved = dropped = 0
    per = N // c.G
    for sl in sorted(overflow):
        t, j = sl // K, sl % K
        best = []
        if c.overflow == "next-best":
            for g in kept_groups[t]:
                for e in range(g * per, (g + 1) * per):
                    if load[e] < cap and e not in final[t]:
                        best.append((s[t, e] + bias[e], e))
            best.sort(key=lambda v: (-v[0], v[1]))
            if len(best) > 1:
                margin = min(margin, best[0][0] - best[1][0])
        if best:
            final[t, j] = best[0][1]
            load[best[0][1]] += 1
            moved += 1
        else:
            kept[t, j] = 0
            dropped += 1
    return final, kept, load, cap, moved, dropped, margin


def layer(c, p, idx_final, kept, sel_idx):
    """The layer's forward from float64 leaves p and the routing decisions: y, L_bal, gates."""
    x = p["x"]
    s = affinities(c, x, p["router_w"])
    weights = s.gather(1, idx_final)                       # original_scores.gather(indices)
    if c.gate == "sigmoid":
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    gates = weights * c.route_scale
    # every routed expert on every token, then the chosen outputs gathered
    h = F.silu(torch.einsum("td,edf->tef", x, p["experts_w1"])) * \
        torch.einsum("td,edf->tef", x, p["experts_w3"])
    out = torch.einsum("tef,efd->ted", h, p["experts_w2"])  # (T, N, d)
    chosen = out[torch.arange(T)[:, None], idx_final]       # (T, K, d)
    y = ((gates * kept.to(torch.float64))[..., None] * chosen).sum(1)
    if c.S > 0:
        y = y + (F.silu(x @ p["shared_w1"]) * (x @ p["shared_w3"])) @ p["shared_w2"]
    # sequence-wise balance loss (report eq. 18): f counts each token's top-K of the unbiased
    # affinities s, a constant
    B = T // L
    topk_s = torch.topk(s.detach(), K, dim=-1).indices
    count = F.one_hot(topk_s, N).sum(1).to(torch.float64).view(B, L, N).sum(1)  # (B, N)
    f = N / (K * L) * count
    P = (s / s.sum(dim=-1, keepdim=True)).view(B, L, N).mean(1)                  # (B, N)
    balance = c.alpha * (f * P).sum(-1).mean()
    return y, balance, gates


def seed003_balance(alpha, s, count_idx):
    """Seed 003's load_balance_sequence_wise, per sequence k (see the module docstring):
    the k >= 1 terms summed, times alpha, and the k = 0 term alone. count_idx: the experts f
    counts, the same as the report's loss (the top-K of s), so that only the loop differs."""
    B = T // L
    total, k0_term = 0.0, None
    for k in range(B):
        s_k = s[k * L:(k + 1) * L]
        count_k = F.one_hot(count_idx[k * L:(k + 1) * L], N).sum((0, 1)).to(torch.float64)
        fi = torch.tensor(float(N), dtype=torch.float64) / (k * L) * count_k  # k = 0: inf
        pi = (s_k / s_k.sum(dim=-1, keepdim=True)).sum(dim=0) / L
        term = (fi * pi).sum() / L
        if k == 0:
            k0_term = alpha * term.item()
        else:
            total += term.item()
    return alpha * total, k0_term


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: dsv3_moe.py OUT_DIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)  # one summation order: the same bytes on every run
    rng = np.random.default_rng(SEED)
    written = []

    def f32(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def save(name, value):
        if isinstance(value, torch.Tensor):
            value = value.detach().numpy()
        value = np.asarray(value)
        value = value.astype(np.int64 if value.dtype.kind in "iub" else np.float32)
        path = os.path.join(out, f"dsv3_{name}.npy")
        np.save(path, value)
        written.append(path)

    t64 = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float64))

    for spec in CASES:
        c = Case(*spec)
        Sf = c.S * FFN
        # draw until every routing decision has a margin (module docstring)
        for attempt in range(1000):
            inputs = {"x": f32(T, D), "dy": f32(T, D), "router_w": f32(D, N, scale=D ** -0.5),
                      "bias": f32(N, scale=BIAS_SPREAD),
                      "experts_w1": f32(N, D, FFN, scale=D ** -0.5),
                      "experts_w3": f32(N, D, FFN, scale=D ** -0.5),
                      "experts_w2": f32(N, FFN, D, scale=FFN ** -0.5),
                      "shared_w1": f32(D, Sf, scale=D ** -0.5),
                      "shared_w3": f32(D, Sf, scale=D ** -0.5),
                      "shared_w2": f32(Sf, D, scale=Sf ** -0.5)}
            s = affinities(c, t64(inputs["x"]), t64(inputs["router_w"]))
            bias = t64(inputs["bias"])
            sel_idx, kept_groups, margin = gate_select(c, s, bias)
            final, kept, load, cap, moved, dropped, cap_margin = apply_capacity(
                c, s.numpy(), bias.numpy(), sel_idx.numpy(), kept_groups.numpy())
            if min(margin, cap_margin) >= MARGIN:
                break
        else:
            sys.exit(f"{c.name}: no draw with routing margins >= {MARGIN}")
        if c.name == "sigmoid_groups":
            # the bias changes at least one token's selection (without it: top-K of s alone)
            unbiased = gate_select(c, s, torch.zeros(N, dtype=torch.float64))[0]
            changed = (unbiased != sel_idx).any(dim=1).sum().item()
            assert changed > 0, "the bias changes no token's selection: raise BIAS_SPREAD"
            print(f"{c.name}: the bias changes {changed} of {T} tokens' experts")
        if c.capacity > 0:
            assert dropped > 0, f"{c.name}: no slot overflows"
            if c.overflow == "next-best":
                assert moved > 0, f"{c.name}: next-best moved no slot"
        else:
            assert moved == 0 and dropped == 0 and np.array_equal(final, sel_idx.numpy())

        name = lambda n: f"{c.name}_{n}"
        config = [0 if c.gate == "sigmoid" else 1, N, K, c.G, c.M, c.gtk, c.S, c.alpha,
                  c.route_scale, c.capacity, 0 if c.overflow == "drop" else 1, L]
        save(name("config"), np.array(config, dtype=np.float64))
        for n, a in inputs.items():
            save(name(n), a)
        leaves = {n: t64(a).requires_grad_() for n, a in inputs.items()
                  if n not in ("dy", "bias")}
        idx_final = torch.from_numpy(final)
        y, balance, gates = layer(c, leaves, idx_final, torch.from_numpy(kept), sel_idx)
        ((y * t64(inputs["dy"])).sum() + balance).backward()
        for n, v in (("sel_idx", sel_idx), ("kept_groups", kept_groups), ("idx", final),
                     ("kept", kept), ("load", load), ("gates", gates), ("y", y),
                     ("balance", balance)):
            save(name(n), v)
        for n, t in leaves.items():
            save(name("dx" if n == "x" else "d_" + n), t.grad)
        print(f"{c.name}: routing margin {min(margin, cap_margin):.2e} (draw {attempt}); "
              f"cap {cap}, moved {moved}, dropped {dropped}; balance {balance.item():.6f}")

        if c.name == "sigmoid_groups":
            skip_k0, k0_term = seed003_balance(c.alpha, s, torch.topk(s, K, dim=-1).indices)
            assert not math.isfinite(k0_term)
            save("seed003_balance_paper", balance)
            save("seed003_balance_skip_k0", np.array(skip_k0))
            save("seed003_balance_k0_term", np.array(k0_term))
            print(f"seed 003's balance loss: {skip_k0:.6f} over k >= 1, k = 0 term {k0_term}; "
                  f"the report's: {balance.item():.6f}")

    total = sum(os.path.getsize(p) for p in written)
    print(f"wrote {len(written)} files, {total} bytes, to {out}")


if __name__ == "__main__":
    main()
