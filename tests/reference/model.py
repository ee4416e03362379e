"""Golden data for the tiny DeepSeek-style language model (common/layers/model.h): PyTorch's
loss, gradients and one AdamW step, which tests/unit/test_model.cpp checks the C++ model
against.

The model, written here from DeepSeek-V3's inference/model.py (RMSNorm, MLA's "naive"
attention path, apply_rotary_emb, Gate, MoE, MLP) and DeepSeek-V2's paper (section 2.1), at
the default config of model.h:

  x = embed[ids]; per layer x += MLA(RMSNorm(x)); x += FFN(RMSNorm(x));
  logits = RMSNorm(x) head; loss = mean cross-entropy of the next token
  MLA: c_q = RMSNorm(u W_dq); q = c_q W_uq viewed (B, T, H, d_nope + d_rope) -> q_nope | q_pe;
       q_pe = rope(q_pe); c_kv = RMSNorm(u W_dkv); k_nope = c_kv W_uk, v = c_kv W_uv per head;
       k_pe = rope(u W_kr): (B, T, d_rope), one per token, shared by every head;
       scores = (q_nope . k_nope + q_pe . k_pe) / sqrt(d_nope + d_rope) (two einsums summed),
       causal mask, softmax, o = p v, out = o W_o
  FFN: layer 0 dense SwiGLU (silu(u W1) * (u W3)) W2; layer 1 the DeepSeek-V3 MoE as
       tests/reference/dsv3_moe.py writes it (sigmoid gate, selection = top-K of s + bias,
       gates = s[idx] / sum s[idx] (route_scale 1), routed SwiGLU experts computed densely and
       gathered, one shared expert; one group, no capacity, no balance loss)

Weights are written here (numpy, fixed seed) and the C++ test loads them by name, rather than
the other way round: this script then needs no C++ build and no copy of the C++ RNG, and it
can redraw the weights until every routing decision has a margin (below). Scales as
model.h's init (matrices N(0,1)/sqrt(fan_in), embedding N(0,1)), except that the norm weights
are 1 + 0.1 N(0,1) and the MoE balancing bias 0.05 N(0,1) (not 1 and 0), so that their
effects are tested.

The batch: B = 2 sequences of T + 1 = 33 bytes of data/tinyshakespeare.txt at offsets drawn
from the training split (the first 90%), as ids into the sorted distinct bytes (65).

What it writes, into the directory given as the only argument:
  model_config      int64 (17 + B): V, d, L, dense_layers, H, d_nope, d_rope, d_v, q_lora,
                    kv_lora, ffn, experts, topk, shared, moe_ffn, T, B, then the B offsets
                    into the corpus
  model_tokens      int64 (B, T + 1)
  model_w_<name>    every parameter and the balancing bias, float32, under model.h's names
  model_route_<i>   int64 (B T, K): the experts of each token in MoE layer i, descending s + b
  model_loss        ()
  model_grad_<name> d loss / d parameter
  model_adamw_<name> the parameter after one torch.optim.AdamW step (lr 1e-3, betas (0.9,
                    0.999), eps 1e-8: common/core/optim.h's AdamConfig defaults, and
                    weight_decay 0.1 instead of its default 0 so that the decoupled decay is
                    exercised)

Precision: the math runs in float64 on the exact float32 weights; only results are rounded to
float32, so the goldens carry no float32 error of their own. The script also runs the same
model in float32 and prints how far PyTorch's own float32 gradients are from the float64 ones,
measured against the C++ test's tolerance (GRAD_TOL, asserted): an independent float32
implementation must pass the same bound. The routing is an integer decision: the draws are
repeated until, in every MoE layer, each token's K-th and (K+1)-th largest s + b differ by at
least MARGIN (float32 activations are within ~1e-5 of these), so the C++ model's routing must
equal this one exactly.

Regenerate (needs Debian's python3-torch; the files are committed, about 1.5 MB):

    /usr/bin/python3 tests/reference/model.py tests/reference/data    (part of make reference)

The output is deterministic: rerunning it rewrites the same bytes.
"""
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

SEED = 20240619
V, D, LAYERS, DENSE, H = 65, 64, 2, 1, 4
D_NOPE, D_ROPE, D_V, Q_LORA, KV_LORA = 16, 8, 16, 32, 32
FFN, EXPERTS, TOPK, SHARED, MOE_FFN = 128, 8, 2, 1, 32
T, B = 32, 2
ROPE_THETA, NORM_EPS = 10000.0, 1e-6
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.1
MARGIN = 1e-4
# The C++ test's gradient tolerance (kGradTol in tests/unit/test_model.cpp says why): every
# element of a gradient within GRAD_TOL * max |that gradient| of the float64 answer.
GRAD_TOL = 2e-5
CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data",
                      "tinyshakespeare.txt")


def param_shapes():
    """model.h's named_parameters order, with shapes."""
    shapes = [("embed", (V, D))]
    for i in range(LAYERS):
        l = f"layers.{i}."
        shapes += [(l + "attn_norm", (D,)), (l + "attn.w_dq", (D, Q_LORA)),
                   (l + "attn.q_norm", (Q_LORA,)), (l + "attn.w_uq", (Q_LORA, H * (D_NOPE + D_ROPE))),
                   (l + "attn.w_dkv", (D, KV_LORA)), (l + "attn.kv_norm", (KV_LORA,)),
                   (l + "attn.w_uk", (KV_LORA, H * D_NOPE)), (l + "attn.w_uv", (KV_LORA, H * D_V)),
                   (l + "attn.w_kr", (D, D_ROPE)), (l + "attn.w_o", (H * D_V, D)),
                   (l + "ffn_norm", (D,))]
        if i < DENSE:
            shapes += [(l + "ffn.w1", (D, FFN)), (l + "ffn.w3", (D, FFN)), (l + "ffn.w2", (FFN, D))]
        else:
            Sf = SHARED * MOE_FFN
            shapes += [(l + "moe.router_w", (D, EXPERTS)),
                       (l + "moe.experts_w1", (EXPERTS, D, MOE_FFN)),
                       (l + "moe.experts_w3", (EXPERTS, D, MOE_FFN)),
                       (l + "moe.experts_w2", (EXPERTS, MOE_FFN, D)),
                       (l + "moe.shared_w1", (D, Sf)), (l + "moe.shared_w3", (D, Sf)),
                       (l + "moe.shared_w2", (Sf, D))]
    return shapes + [("norm", (D,)), ("head", (D, V))]


def draw_weights(rng):
    w = {}
    for name, shape in param_shapes():
        z = rng.standard_normal(shape)
        if name.endswith("norm"):
            w[name] = (1.0 + 0.1 * z).astype(np.float32)
        elif name == "embed":
            w[name] = z.astype(np.float32)
        else:
            w[name] = (z / math.sqrt(shape[-2])).astype(np.float32)
    for i in range(DENSE, LAYERS):
        w[f"layers.{i}.moe.bias"] = (0.05 * rng.standard_normal(EXPERTS)).astype(np.float32)
    return w


def rmsnorm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * weight


def apply_rotary_emb(x, positions):
    """DeepSeek-V3's apply_rotary_emb: consecutive pairs of the last dim as complex numbers,
    times polar(1, pos theta^(-2i/D)). x (B, T, ..., D)."""
    Dr = x.shape[-1]
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, Dr, 2, dtype=torch.float64) / Dr))
    angles = torch.outer(positions.to(torch.float64), freqs)                   # (T, D/2)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    if x.dtype == torch.float32:
        freqs_cis = freqs_cis.to(torch.complex64)
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x.shape[1], *([1] * (x.dim() - 3)), Dr // 2)
    return torch.view_as_real(xc * freqs_cis).flatten(-2)


def mla(p, l, u, positions):
    """MLA, the naive path: u (B, T, d) -> (B, T, d)."""
    q = rmsnorm(u @ p[l + "attn.w_dq"], p[l + "attn.q_norm"]) @ p[l + "attn.w_uq"]
    q = q.view(B, T, H, D_NOPE + D_ROPE)
    q_nope, q_pe = q[..., :D_NOPE], apply_rotary_emb(q[..., D_NOPE:], positions)
    c_kv = rmsnorm(u @ p[l + "attn.w_dkv"], p[l + "attn.kv_norm"])
    k_nope = (c_kv @ p[l + "attn.w_uk"]).view(B, T, H, D_NOPE)
    v = (c_kv @ p[l + "attn.w_uv"]).view(B, T, H, D_V)
    k_pe = apply_rotary_emb(u @ p[l + "attn.w_kr"], positions)                   # (B, T, d_rope)
    scores = (torch.einsum("bshd,bthd->bsht", q_nope, k_nope) +
              torch.einsum("bshr,btr->bsht", q_pe, k_pe)) / math.sqrt(D_NOPE + D_ROPE)
    mask = torch.full((T, T), float("-inf"), dtype=u.dtype).triu_(1)
    probs = (scores + mask.view(1, T, 1, T)).softmax(dim=-1)
    o = torch.einsum("bsht,bthd->bshd", probs, v)
    return o.flatten(2) @ p[l + "attn.w_o"]


def swiglu(u, w1, w3, w2):
    return (F.silu(u @ w1) * (u @ w3)) @ w2


def moe_route(s, bias):
    """Selection on s + bias (one group): idx (N, K) descending, and the smallest gap between
    each token's K-th and (K+1)-th biased affinity."""
    scores = s + bias
    idx = scores.topk(TOPK, dim=-1)[1]
    top = scores.sort(dim=-1, descending=True)[0]
    return idx, (top[:, TOPK - 1] - top[:, TOPK]).min().item()


def moe(p, l, u):
    """The DeepSeek-V3 MoE of tests/reference/dsv3_moe.py with G = 1, no capacity, alpha 0:
    u (N, d) -> (N, d), the route and its margin."""
    s = torch.sigmoid(u @ p[l + "moe.router_w"])                           # original_scores
    idx, margin = moe_route(s.detach(), p[l + "moe.bias"])
    weights = s.gather(1, idx)
    gates = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)           # route_scale 1
    h = F.silu(torch.einsum("td,edf->tef", u, p[l + "moe.experts_w1"])) * \
        torch.einsum("td,edf->tef", u, p[l + "moe.experts_w3"])
    out = torch.einsum("tef,efd->ted", h, p[l + "moe.experts_w2"])         # (N, E, d)
    chosen = out[torch.arange(u.shape[0])[:, None], idx]                   # (N, K, d)
    y = (gates[..., None] * chosen).sum(1)
    y = y + swiglu(u, p[l + "moe.shared_w1"], p[l + "moe.shared_w3"], p[l + "moe.shared_w2"])
    return y, idx, margin


def model_loss(p, tokens):
    """The loss of a (B, T + 1) batch, the routes and the smallest routing margin."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(T)
    x = p["embed"][inputs]                                                 # (B, T, d)
    routes, margin = [], math.inf
    for i in range(LAYERS):
        l = f"layers.{i}."
        x = x + mla(p, l, rmsnorm(x, p[l + "attn_norm"]), positions)
        u = rmsnorm(x, p[l + "ffn_norm"])
        if i < DENSE:
            x = x + swiglu(u, p[l + "ffn.w1"], p[l + "ffn.w3"], p[l + "ffn.w2"])
        else:
            y, idx, m = moe(p, l, u.reshape(B * T, D))
            x = x + y.view(B, T, D)
            routes.append((i, idx))
            margin = min(margin, m)
    logits = rmsnorm(x, p["norm"]) @ p["head"]
    loss = F.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T))
    return loss, routes, margin


def leaves(w, dtype):
    return {n: torch.tensor(a, dtype=dtype, requires_grad=not n.endswith(".bias"))
            for n, a in w.items()}


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: model.py OUT_DIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)  # one summation order: the same bytes on every run
    rng = np.random.default_rng(SEED)
    written = []

    def save(name, value):
        if isinstance(value, torch.Tensor):
            value = value.detach().numpy()
        value = np.asarray(value)
        value = value.astype(np.int64 if value.dtype.kind in "iub" else np.float32)
        path = os.path.join(out, f"model_{name}.npy")
        np.save(path, value)
        written.append(path)

    with open(CORPUS, "rb") as f:
        text = f.read()
    vocab = sorted(set(text))
    assert len(vocab) == V, f"the corpus has {len(vocab)} distinct bytes, the model {V}"
    id_of = {b: i for i, b in enumerate(vocab)}
    train = len(text) * 9 // 10
    offsets = rng.integers(0, train - (T + 1), size=B)
    tokens = np.array([[id_of[b] for b in text[o:o + T + 1]] for o in offsets], dtype=np.int64)
    tok = torch.from_numpy(tokens)

    # draw until every routing decision has a margin (module docstring)
    for attempt in range(100):
        w = draw_weights(rng)
        p = leaves(w, torch.float64)
        loss, routes, margin = model_loss(p, tok)
        if margin >= MARGIN:
            break
    else:
        sys.exit(f"no draw with routing margins >= {MARGIN}")
    # the bias changes at least one token's experts (else selection on s + b is untested)
    for i, idx in routes:
        q = dict(p)
        q[f"layers.{i}.moe.bias"] = torch.zeros(EXPERTS, dtype=torch.float64)
        with torch.no_grad():
            routes0 = dict(model_loss(q, tok)[1])
        changed = (routes0[i] != idx).any(dim=1).sum().item()
        assert changed > 0, f"layer {i}: the bias changes no token's experts"
        print(f"layer {i}: the bias changes {changed} of {B * T} tokens' experts")
    loss.backward()

    config = [V, D, LAYERS, DENSE, H, D_NOPE, D_ROPE, D_V, Q_LORA, KV_LORA, FFN, EXPERTS, TOPK,
              SHARED, MOE_FFN, T, B] + [int(o) for o in offsets]
    save("config", np.array(config, dtype=np.int64))
    save("tokens", tokens)
    for n, a in w.items():
        save("w_" + n, a)
    for i, idx in routes:
        save(f"route_{i}", idx)
    save("loss", loss)
    names = [n for n, _ in param_shapes()]
    for n in names:
        save("grad_" + n, p[n].grad)

    # PyTorch's own float32 model against the float64 answer, with the C++ test's bound
    p32 = leaves(w, torch.float32)
    loss32, routes32, _ = model_loss(p32, tok)
    loss32.backward()
    for (i, a), (_, b) in zip(routes, routes32):
        assert torch.equal(a, b), f"layer {i}: float32 routing differs"
    worst = 0.0
    for n in names:
        g64 = p[n].grad.numpy()
        err = np.abs(p32[n].grad.numpy().astype(np.float64) - g64).max() / np.abs(g64).max()
        worst = max(worst, err)
        assert err <= GRAD_TOL, f"{n}: torch float32 error {err:.2e} of max |grad| > {GRAD_TOL}"
    print(f"loss {loss.item():.6f} (float32 torch: {loss32.item():.6f}); torch float32 gradients: "
          f"max error {worst:.2e} of max |grad| (GRAD_TOL {GRAD_TOL:.0e})")

    # one AdamW step from the float64 gradients
    opt = torch.optim.AdamW([p[n] for n in names], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY, foreach=False)
    opt.step()
    for n in names:
        save("adamw_" + n, p[n])
    small = sum(int(((p[n].grad.abs() > 0) & (p[n].grad.abs() < 1e-6)).sum()) for n in names)
    print(f"routing margin {margin:.2e} (draw {attempt}); {small} gradient entries in (0, 1e-6)")

    total = sum(os.path.getsize(q) for q in written)
    print(f"wrote {len(written)} files, {total} bytes, to {out}")


if __name__ == "__main__":
    main()
