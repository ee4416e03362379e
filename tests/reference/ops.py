"""Golden data for the core ops: PyTorch's answers that tests/unit/test_golden.cpp checks.

What it writes, into the directory given as the only argument, one .npy file per tensor
named <case>_<tensor>.npy (float32, except the int64 targets):

  case             inputs                       upstream   outputs and input gradients
  softmax          x (4, 10)                    dy         y, dx
  softmax_large    x (3, 8), values ~ +-1000    dy         y, dx
  cross_entropy    logits (6, 11), targets (6)  dy ()      logp = log_softmax(logits),
                                                           loss () = mean NLL, dlogits
  rmsnorm          x (2, 3, 16), weight (16),   dy         y, dx, dweight
                   eps ()
  matmul           a (5, 7), b (7, 4)           dy         c, da, db
  matmul_batched   a (3, 4, 6), b (3, 6, 5)     dy         c, da, db
  matmul_shared    a (2, 3, 6), b (6, 5)        dy         c, da, db  (b shared by the batch)
  silu             x (4, 9)                     dy         y, dx
  sigmoid          x (4, 9)                     dy         y, dx
  mlp              x (8, 16), w1 (16, 32),      dy ()      loss (), dx, dw1, db1, dw2, db2
                   b1 (32), w2 (32, 10),
                   b2 (10), targets (8)
                   loss = cross_entropy(silu(x @ w1 + b1) @ w2 + b2, targets)
  attention        q, k, v (2, 20, 8), scale ()  dy         o, lse, dq, dk, dv
  attention_causal the same, causal                         (2 = batch x heads; 20 tokens)
                   o = softmax(q k^T * scale + mask) v, lse = logsumexp of the masked scores;
                   causal: query i sees key j <= i. For the flash_forward_block and
                   flash_backward_block kernels (tests/unit/test_kernels_attention.cpp).
  moe_softmax_topk x (10, 6), router_w (6, 4),  dy         y, aux (), topk_idx (10, 2) int64,
  moe_topk_softmax router_b (4), w1, w3          (10, 6)    gates (10, 2), dx, d_router_w,
                   (4, 6, 8), w2 (4, 8, 6),                d_router_b, d_w1, d_w2, d_w3
                   alpha (), k = 2
                   The sparse MoE layer of common/layers/moe.h (lesson 03): z = x router_w + router_b,
                   p = softmax(z); softmax_topk: idx = topk(p, 2), g = p[idx]; topk_softmax:
                   idx = topk(z, 2), g = softmax(z[idx]); y_t = sum_j g_tj E_idx_tj(x_t), E a
                   SwiGLU expert (silu(x w1) * (x w3)) w2; aux = alpha N sum_i f_i P_i with
                   f_i = count_i / (k T) a constant and P_i = mean_t p_ti differentiable. The
                   gradients are of L = sum(y * dy) + aux (tests/unit/test_moe.cpp).
  rope             x (7, 3, 16), positions (7)  dy         y, dx
                   int64, theta ()
  rope_k           x (5, 64), positions (5)     dy         y, dx
                   int64, theta ()
                   Rotary position embedding as DeepSeek-V3's apply_rotary_emb: consecutive
                   pairs of the last dim as complex numbers (torch.view_as_complex) times
                   torch.polar(1, positions * theta^(-2i/D)); the middle dim (heads, as in MLA's
                   q_pe) shares its token's position, rope_k is a (T, D) k_pe. Positions are
                   explicit, unsorted, up to 100000 (tests/unit/test_golden.cpp).

Inputs are float32, drawn by numpy from a fixed seed; the C++ test loads them from the
files (it does not reproduce the RNG). The reference math runs in float64 on those exact
float32 values and only the results are rounded to float32, so the goldens carry no
float32 error of their own. Each gradient is for the saved upstream gradient dy
(x.grad after y.backward(dy)).

Regenerate (needs Debian's python3-torch; the files are committed, a few KB each):

    make reference          # = /usr/bin/python3 tests/reference/ops.py tests/reference/data

The output is deterministic: rerunning it rewrites the same bytes.
"""
import os
import sys

import numpy as np
import torch

SEED = 20240601


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: ops.py OUT_DIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)  # one summation order: the same bytes on every run
    rng = np.random.default_rng(SEED)
    written = []

    def f32(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def save(case, name, value):
        if isinstance(value, torch.Tensor):
            value = value.detach().numpy()
        value = np.asarray(value)
        value = value.astype(np.int64 if value.dtype.kind in "iu" else np.float32)
        path = os.path.join(out, f"{case}_{name}.npy")
        np.save(path, value)
        written.append(path)

    def leaf(a):  # float32 numpy -> float64 torch leaf (exact)
        return torch.from_numpy(a.astype(np.float64)).requires_grad_()

    def run_case(case, fn, inputs, dy_shape=None, dy_value=None, extra=None):
        """inputs: {name: float32 array}; fn(**leaves) -> {name: output}, the first output
        is the one dy flows into."""
        for name, a in inputs.items():
            save(case, name, a)
        leaves = {name: leaf(a) for name, a in inputs.items()}
        outs = fn(**leaves)
        first = next(iter(outs.values()))
        if dy_value is not None:
            dy = np.array(dy_value, dtype=np.float32)
        else:
            dy = f32(*first.shape)
        save(case, "dy", dy)
        first.backward(torch.from_numpy(dy.astype(np.float64)))
        for name, o in outs.items():
            save(case, name, o)
        for name, t in leaves.items():
            save(case, "d" + name, t.grad)
        for name, a in (extra or {}).items():
            save(case, name, a)

    # ---- softmax, on ordinary rows and on rows of magnitude ~1000 (a naive exp overflows)
    run_case("softmax", lambda x: {"y": torch.softmax(x, -1)}, {"x": f32(4, 10, scale=2.0)})
    # rows near +1000 and -1000 with spread ~2 (exp(1000) overflows float64 too, so only
    # a max-subtracting softmax survives), and a row of spread ~1000 (nearly one-hot)
    large = f32(3, 8, scale=2.0)
    large[0] += 1000.0
    large[1] -= 1000.0
    large[2] *= 500.0
    run_case("softmax_large", lambda x: {"y": torch.softmax(x, -1)}, {"x": large})

    # ---- cross-entropy = log_softmax then NLL, mean over rows; one row of large logits
    logits = f32(6, 11, scale=2.0)
    logits[2] *= 100.0
    targets = rng.integers(0, 11, size=6).astype(np.int64)
    t_targets = torch.from_numpy(targets)

    def cross_entropy(logits):
        logp = torch.log_softmax(logits, -1)
        loss = torch.nn.functional.nll_loss(logp, t_targets)
        return {"loss": loss, "logp": logp}

    save("cross_entropy", "targets", targets)
    run_case("cross_entropy", cross_entropy, {"logits": logits}, dy_value=0.75)

    # ---- rmsnorm over the last dim: y = x / sqrt(mean(x^2) + eps) * weight
    eps = np.float32(1e-5)

    def rmsnorm(x, weight):
        rms = torch.sqrt((x * x).mean(-1, keepdim=True) + float(eps))
        return {"y": x / rms * weight}

    run_case("rmsnorm", rmsnorm,
             {"x": f32(2, 3, 16), "weight": (1.0 + f32(16, scale=0.1)).astype(np.float32)},
             extra={"eps": np.array(eps, dtype=np.float32)})

    # ---- matmul: 2-D, batched (3-D @ 3-D), and a 2-D b shared by a batch of a
    mm = lambda a, b: {"c": torch.matmul(a, b)}
    run_case("matmul", mm, {"a": f32(5, 7), "b": f32(7, 4)})
    run_case("matmul_batched", mm, {"a": f32(3, 4, 6), "b": f32(3, 6, 5)})
    run_case("matmul_shared", mm, {"a": f32(2, 3, 6), "b": f32(6, 5)})

    # ---- silu and sigmoid, including saturated inputs
    def activation_input():
        x = f32(4, 9, scale=4.0)
        x[0, :4] = [-30.0, -12.0, 12.0, 30.0]
        return x

    run_case("silu", lambda x: {"y": torch.nn.functional.silu(x)}, {"x": activation_input()})
    run_case("sigmoid", lambda x: {"y": torch.sigmoid(x)}, {"x": activation_input()})

    # ---- a 2-layer MLP: linear -> silu -> linear -> cross-entropy
    mlp_targets = rng.integers(0, 10, size=8).astype(np.int64)

    def mlp(x, w1, b1, w2, b2):
        h = torch.nn.functional.silu(x @ w1 + b1)
        logits = h @ w2 + b2
        return {"loss": torch.nn.functional.cross_entropy(logits, torch.from_numpy(mlp_targets))}

    save("mlp", "targets", mlp_targets)
    run_case("mlp", mlp,
             {"x": f32(8, 16), "w1": f32(16, 32, scale=16 ** -0.5), "b1": f32(32, scale=0.1),
              "w2": f32(32, 10, scale=32 ** -0.5), "b2": f32(10, scale=0.1)},
             dy_value=1.0)

    # ---- attention (lesson 02's flash blocks), non-causal and causal. Appended last, so the
    # cases above draw the same random numbers as before. scale = 1/sqrt(D) rounded to float32,
    # saved, and used at that value (as rmsnorm's eps).
    attn_scale = np.float32(1.0 / np.sqrt(8.0))

    def attention(causal):
        def fn(q, k, v):
            s = q @ k.transpose(-1, -2) * float(attn_scale)
            if causal:
                n = s.shape[-1]
                hidden = torch.ones(n, n, dtype=torch.bool).triu(1)  # key j > query i
                s = s.masked_fill(hidden, float("-inf"))
            return {"o": torch.softmax(s, -1) @ v, "lse": torch.logsumexp(s, -1)}
        return fn

    for case, causal in (("attention", False), ("attention_causal", True)):
        run_case(case, attention(causal), {"q": f32(2, 20, 8), "k": f32(2, 20, 8), "v": f32(2, 20, 8)},
                 extra={"scale": np.array(attn_scale, dtype=np.float32)})

    # ---- the mixture-of-experts layer (lesson 03), for both gates. Appended after attention,
    # so every case above keeps its random numbers. The experts run densely on every token
    # here and the chosen outputs are gathered (not common/layers/moe.cpp's permute or loop form).
    moe_alpha = np.float32(0.5)  # not 1: a missing alpha factor must show

    def moe_layer(gate, k):
        def fn(x, router_w, router_b, w1, w3, w2):
            T, N = x.shape[0], router_w.shape[1]
            z = x @ router_w + router_b
            p = torch.softmax(z, -1)
            if gate == "softmax_topk":
                g, idx = torch.topk(p, k, dim=-1)  # descending, no renormalisation
            else:
                vals, idx = torch.topk(z, k, dim=-1)
                g = torch.softmax(vals, -1)
            h = torch.nn.functional.silu(torch.einsum("td,edf->tef", x, w1)) * \
                torch.einsum("td,edf->tef", x, w3)
            out = torch.einsum("tef,efd->ted", h, w2)         # every expert on every token
            chosen = out[torch.arange(T)[:, None], idx]        # (T, k, d)
            y = (g[..., None] * chosen).sum(1)
            count = torch.nn.functional.one_hot(idx, N).sum((0, 1)).to(torch.float64)
            f = count / (k * T)                                # a constant: no gradient
            aux = float(moe_alpha) * N * (f * p.mean(0)).sum()
            return y, aux, idx, g
        return fn

    def moe_case(case, gate, T=10, d=6, f=8, N=4, k=2):
        # Draw until every token's ranking among its top k + 1 logits is decided by a margin
        # of 1e-3 (float32 logits are within ~1e-6 of these): the C++ routing must equal this
        # one exactly. The draws are deterministic, so the same inputs come out every run.
        while True:
            inputs = {"x": f32(T, d), "router_w": f32(d, N, scale=d ** -0.5),
                      "router_b": f32(N, scale=0.1), "w1": f32(N, d, f, scale=d ** -0.5),
                      "w3": f32(N, d, f, scale=d ** -0.5), "w2": f32(N, f, d, scale=f ** -0.5)}
            z = inputs["x"].astype(np.float64) @ inputs["router_w"] + inputs["router_b"]
            top = -np.sort(-z, axis=-1)[:, :min(k + 1, N)]
            if (top[:, :-1] - top[:, 1:]).min() > 1e-3:
                break
        for name, a in inputs.items():
            save(case, name, a)
        leaves = {name: leaf(a) for name, a in inputs.items()}
        y, aux, idx, g = moe_layer(gate, k)(**leaves)
        dy = f32(T, d)
        save(case, "dy", dy)
        ((y * torch.from_numpy(dy.astype(np.float64))).sum() + aux).backward()
        for name, value in (("y", y), ("aux", aux), ("topk_idx", idx), ("gates", g),
                            ("alpha", np.array(moe_alpha))):
            save(case, name, value)
        for name, t in leaves.items():
            save(case, "d" + name if name == "x" else "d_" + name, t.grad)

    moe_case("moe_softmax_topk", "softmax_topk")
    moe_case("moe_topk_softmax", "topk_softmax")

    # ---- rotary position embedding, DeepSeek-V3's way (inference/model.py: precompute_freqs_cis
    # and apply_rotary_emb), in float64 with no YaRN scaling. Appended after the MoE cases, so
    # every case above keeps its random numbers.
    rope_theta = np.float32(10000.0)

    def rope(positions):
        t_pos = torch.from_numpy(positions).to(torch.float64)

        def fn(x):
            D = x.shape[-1]
            freqs = 1.0 / (float(rope_theta) ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
            angles = torch.outer(t_pos, freqs)                         # (T, D/2)
            freqs_cis = torch.polar(torch.ones_like(angles), angles)
            xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))  # (T, ..., D/2)
            freqs_cis = freqs_cis.view(x.shape[0], *([1] * (x.dim() - 2)), D // 2)
            return {"y": torch.view_as_real(xc * freqs_cis).flatten(-2)}
        return fn

    for case, shape, positions in (
            ("rope", (7, 3, 16), [100000, 0, 5, 1, 4096, 31, 5]),
            ("rope_k", (5, 64), [3, 0, 65535, 12, 100000])):
        positions = np.array(positions, dtype=np.int64)
        save(case, "positions", positions)
        run_case(case, rope(positions), {"x": f32(*shape)},
                 extra={"theta": np.array(rope_theta, dtype=np.float32)})

    total = sum(os.path.getsize(p) for p in written)
    print(f"wrote {len(written)} files, {total} bytes, to {out}")


if __name__ == "__main__":
    main()
