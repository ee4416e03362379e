"""make bench's lesson 08 entry: one training step of the single-process model on the cpu, in
tokens/s, next to the same model in PyTorch (eager, float32, on as many threads) timed in the
same run.

    /usr/bin/python3 tests/bench/bench_08.py [--lesson build/bin/08_mesh] [model flags]

The step is the one lesson 08 times on one process (-np 1: its mesh code on a mesh of one rank,
the vocabulary-parallel cross-entropy included): forward, backward, AdamW (lr 3e-3, betas (0.9, 0.999),
eps 1e-8, no weight decay: common/core/optim.h's AdamConfig with the lesson's --lr) and the
MoE balancing bias update (bias += gamma sign(mean load - load)), on a batch of --batch
sequences of --seq tokens of the corpus. The model is tests/reference/model.py's (MLA with
RoPE, dense SwiGLU, the DeepSeek-V3 MoE with sigmoid gate and balancing bias), written here for
any size and in float32, with random weights drawn as common/layers/model.cpp's init_params
draws them (matrices N(0, 1) / sqrt(fan-in), embedding N(0, 1), norm weights 1, biases 0).
Where model.py computes every routed expert on every token (a golden needs no speed), the
routed experts here run as DeepSeek-V3's inference/model.py runs them: a loop over the experts,
each on the tokens sent to it (--moe dense: model.py's way, for comparison).

The model flags have lesson 08's names and defaults (--dim, --layers, --batch, --seq, ...).

Threads: OMP_NUM_THREADS when set, else this process's cores; the lesson gets it as
OMP_NUM_THREADS, PyTorch's own ops by torch.set_num_threads. PyTorch's matrix products run in
OpenBLAS (Debian's python3-torch links it; BLAS_INFO=generic), whose pthreads pool is separate
from PyTorch's OpenMP one: with both on N threads, each pool's waiting threads spin on the cores
the other needs, and small products get several times slower. So PyTorch is timed twice, its ops
on N threads and OpenBLAS given N, then 1 (openblas_set_num_threads; never more than N busy
threads), and the faster is the figure compared. PyTorch runs at its best on this CPU, whatever
the environment sets (fair.py: OpenBLAS's and ATen's kernels chosen from the CPU's flags; with
FF_CPU_ISA=avx2 both sides on AVX2); the summary names the instruction set each side runs, and
gives no ratio where they differ.

PyTorch's figure: after --warmup untimed steps, --repeats repeats of --steps steps timed
together (by default as many steps as take about --repeat-s seconds, from one step's time), the
median repeat. With --lesson, the lesson runs first, as one process on the cpu ($MPIRUN -np 1,
MPIRUN as the Makefile exports it, else plain mpirun; --device cpu; --train --lesson-steps, by
default 25600 tokens' worth; the check only at the first and the last step, which the lesson
leaves out of its timing), with the same model flags; its figure is the lesson's own, the mean
step over the run ("training: X ms per step ..., Y tokens/s"). The last line is the summary,
one line:

    lesson 08: one training step, single process, cpu, d 64, batch 8 x 32 tokens: fivefold
    X tokens/s, PyTorch eager float32 Y tokens/s (same 2 threads; kernels: fivefold AVX2, PyTorch's
    ops AVX2, OpenBLAS Haswell (AVX2)): ratio X/Y = Z

Figures only: nothing is asserted about them. The script fails when the lesson fails, or when
the two models' parameter counts differ (then they are not the same model).
"""
import argparse
import ctypes
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time


def thread_count():
    """OMP_NUM_THREADS when set, else the cores this process may run on."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))


# OpenBLAS and OpenMP read these when they load, that is when torch is imported
THREADS = thread_count()
os.environ["OMP_NUM_THREADS"] = str(THREADS)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fair  # noqa: E402

fair.set_reference_env()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
ROPE_THETA, NORM_EPS = 10000.0, 1e-6
# lesson 08's model flags and defaults (lessons/08_mesh/main.cpp), passed on to it unchanged
MODEL_FLAGS = [("dim", 64), ("layers", 2), ("dense-layers", 1), ("heads", 4), ("d-nope", 16),
               ("d-rope", 8), ("d-v", 16), ("q-lora", 32), ("kv-lora", 32), ("ffn", 128),
               ("experts", 8), ("topk", 2), ("shared", 1), ("moe-ffn", 32), ("batch", 8),
               ("seq", 32), ("lr", 3e-3), ("bias-rate", 1e-3)]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in MODEL_FLAGS:
        ap.add_argument("--" + name, type=type(default), default=default,
                        help=f"as lesson 08's --{name} (default {default})")
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "tinyshakespeare.txt"),
                    help="the training text; its distinct bytes are the vocabulary")
    ap.add_argument("--steps", type=int, default=0,
                    help="PyTorch: steps timed per repeat (0: as many as take --repeat-s)")
    ap.add_argument("--repeat-s", type=float, default=0.25,
                    help="PyTorch: seconds a repeat should take, when --steps is 0")
    ap.add_argument("--warmup", type=int, default=3, help="PyTorch: untimed steps first")
    ap.add_argument("--repeats", type=int, default=5, help="PyTorch: repeats, the median quoted")
    ap.add_argument("--moe", choices=["loop", "dense"], default="loop",
                    help="PyTorch's routed experts: each on its own tokens (DeepSeek-V3's "
                         "inference code), or every expert on every token (model.py's)")
    ap.add_argument("--lesson", default=None,
                    help="lesson 08's binary: run it too and print the ratio")
    ap.add_argument("--lesson-steps", type=int, default=0,
                    help="the lesson's --train (0: 25600 tokens' worth, at least 20 steps)")
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


# ----------------------------------------------------------------------------
# the model: tests/reference/model.py's functions with the sizes as arguments

def param_shapes(a, V):
    """model.h's named_parameters, with shapes."""
    D, H, E = a.dim, a.heads, a.experts
    shapes = [("embed", (V, D))]
    for i in range(a.layers):
        l = f"layers.{i}."
        shapes += [(l + "attn_norm", (D,)), (l + "attn.w_dq", (D, a.q_lora)),
                   (l + "attn.q_norm", (a.q_lora,)),
                   (l + "attn.w_uq", (a.q_lora, H * (a.d_nope + a.d_rope))),
                   (l + "attn.w_dkv", (D, a.kv_lora)), (l + "attn.kv_norm", (a.kv_lora,)),
                   (l + "attn.w_uk", (a.kv_lora, H * a.d_nope)),
                   (l + "attn.w_uv", (a.kv_lora, H * a.d_v)), (l + "attn.w_kr", (D, a.d_rope)),
                   (l + "attn.w_o", (H * a.d_v, D)), (l + "ffn_norm", (D,))]
        if i < a.dense_layers:
            shapes += [(l + "ffn.w1", (D, a.ffn)), (l + "ffn.w3", (D, a.ffn)),
                       (l + "ffn.w2", (a.ffn, D))]
        else:
            shapes += [(l + "moe.router_w", (D, E)), (l + "moe.experts_w1", (E, D, a.moe_ffn)),
                       (l + "moe.experts_w3", (E, D, a.moe_ffn)),
                       (l + "moe.experts_w2", (E, a.moe_ffn, D))]
            if a.shared > 0:
                Sf = a.shared * a.moe_ffn
                shapes += [(l + "moe.shared_w1", (D, Sf)), (l + "moe.shared_w3", (D, Sf)),
                           (l + "moe.shared_w2", (Sf, D))]
    return shapes + [("norm", (D,)), ("head", (D, V))]


def init_params(a, V, gen):
    """Leaves drawn as model.cpp's init_params: norms 1, embedding N(0, 1), matrices (and
    stacks of them) N(0, 1) / sqrt(rows); the balancing biases 0, no gradient."""
    p = {}
    for name, shape in param_shapes(a, V):
        if name.endswith("norm"):
            t = torch.ones(shape)
        elif name == "embed":
            t = torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-2])
        p[name] = t.requires_grad_()
    buffers = {f"layers.{i}.moe.bias": torch.zeros(a.experts)
               for i in range(a.dense_layers, a.layers)}
    return p, buffers


def rmsnorm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * weight


def rope_table(T, d_rope):
    """DeepSeek-V3's freqs_cis: polar(1, pos theta^(-2i/d_rope)), (T, d_rope / 2) complex64."""
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, d_rope, 2, dtype=torch.float64) / d_rope))
    angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rotary_emb(x, freqs_cis):
    """Consecutive pairs of the last dim as complex numbers, times freqs_cis. x (B, T, ..., D)."""
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    f = freqs_cis.view(1, x.shape[1], *([1] * (x.dim() - 3)), x.shape[-1] // 2)
    return torch.view_as_real(xc * f).flatten(-2)


def mla(a, p, l, u, freqs_cis, mask):
    """MLA, the naive path: u (B, T, d) -> (B, T, d)."""
    B, T, H = u.shape[0], u.shape[1], a.heads
    q = rmsnorm(u @ p[l + "attn.w_dq"], p[l + "attn.q_norm"]) @ p[l + "attn.w_uq"]
    q = q.view(B, T, H, a.d_nope + a.d_rope)
    q_nope, q_pe = q[..., :a.d_nope], apply_rotary_emb(q[..., a.d_nope:], freqs_cis)
    c_kv = rmsnorm(u @ p[l + "attn.w_dkv"], p[l + "attn.kv_norm"])
    k_nope = (c_kv @ p[l + "attn.w_uk"]).view(B, T, H, a.d_nope)
    v = (c_kv @ p[l + "attn.w_uv"]).view(B, T, H, a.d_v)
    k_pe = apply_rotary_emb(u @ p[l + "attn.w_kr"], freqs_cis)               # (B, T, d_rope)
    scores = (torch.einsum("bshd,bthd->bsht", q_nope, k_nope) +
              torch.einsum("bshr,btr->bsht", q_pe, k_pe)) / math.sqrt(a.d_nope + a.d_rope)
    probs = (scores + mask.view(1, T, 1, T)).softmax(dim=-1)
    o = torch.einsum("bsht,bthd->bshd", probs, v)
    return o.flatten(2) @ p[l + "attn.w_o"]


def swiglu(u, w1, w3, w2):
    return (F.silu(u @ w1) * (u @ w3)) @ w2


def moe(a, p, l, bias, u):
    """The DeepSeek-V3 MoE (one group, no capacity, no balance loss): u (N, d) -> (N, d) and
    each expert's load, the number of tokens sent to it."""
    s = torch.sigmoid(u @ p[l + "moe.router_w"])                           # original scores
    idx = (s.detach() + bias).topk(a.topk, dim=-1)[1]                     # selection on s + b
    weights = s.gather(1, idx)
    gates = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)           # route_scale 1
    w1, w3, w2 = p[l + "moe.experts_w1"], p[l + "moe.experts_w3"], p[l + "moe.experts_w2"]
    load = torch.bincount(idx.flatten(), minlength=a.experts)
    if a.moe == "dense":  # model.py: every expert on every token, then the chosen gathered
        h = F.silu(torch.einsum("td,edf->tef", u, w1)) * torch.einsum("td,edf->tef", u, w3)
        out = torch.einsum("tef,efd->ted", h, w2)
        chosen = out[torch.arange(u.shape[0])[:, None], idx]
        y = (gates[..., None] * chosen).sum(1)
    else:  # DeepSeek-V3's inference/model.py MoE.forward: each expert on its own tokens
        y = torch.zeros_like(u)
        for e, n in enumerate(load.tolist()):
            if n == 0:
                continue
            tok, slot = torch.where(idx == e)
            y = y.index_add(0, tok, swiglu(u[tok], w1[e], w3[e], w2[e]) * gates[tok, slot, None])
    if a.shared > 0:
        y = y + swiglu(u, p[l + "moe.shared_w1"], p[l + "moe.shared_w3"], p[l + "moe.shared_w2"])
    return y, load


def model_loss(a, p, buffers, inputs, targets, freqs_cis, mask):
    """The mean next-token cross-entropy of inputs (B, T), and each MoE layer's loads."""
    B, T = inputs.shape
    x = p["embed"][inputs]                                                 # (B, T, d)
    loads = {}
    for i in range(a.layers):
        l = f"layers.{i}."
        x = x + mla(a, p, l, rmsnorm(x, p[l + "attn_norm"]), freqs_cis, mask)
        u = rmsnorm(x, p[l + "ffn_norm"])
        if i < a.dense_layers:
            x = x + swiglu(u, p[l + "ffn.w1"], p[l + "ffn.w3"], p[l + "ffn.w2"])
        else:
            y, loads[l + "moe.bias"] = moe(a, p, l, buffers[l + "moe.bias"], u.reshape(B * T, -1))
            x = x + y.view(B, T, -1)
    logits = rmsnorm(x, p["norm"]) @ p["head"]
    return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T)), loads


# ----------------------------------------------------------------------------
# the PyTorch measurement

def loaded_openblas():
    """The OpenBLAS PyTorch loaded (None when its BLAS is another one)."""
    try:
        lib = ctypes.CDLL("libopenblas.so.0", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    lib.openblas_get_corename.restype = ctypes.c_char_p
    return lib


def bench_torch(a, threads):
    """PyTorch's step at each OpenBLAS thread count tried: a list of (OpenBLAS threads, steps
    per repeat, median tokens/s, every repeat's tokens/s); and the parameter count."""
    torch.set_num_threads(threads)
    with open(a.data, "rb") as f:
        text = f.read()
    vocab = sorted(set(text))
    lut = torch.zeros(256, dtype=torch.int64)
    lut[list(vocab)] = torch.arange(len(vocab))
    train = lut[torch.frombuffer(bytearray(text[:len(text) * 9 // 10]), dtype=torch.uint8).long()]
    gen = torch.Generator().manual_seed(a.seed)
    p, buffers = init_params(a, len(vocab), gen)
    opt = torch.optim.AdamW(list(p.values()), lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    B, T = a.batch, a.seq
    freqs_cis = rope_table(T, a.d_rope)
    mask = torch.full((T, T), float("-inf")).triu_(1)
    window = torch.arange(T + 1)

    def step():
        starts = torch.randint(0, train.numel() - (T + 1), (B, 1), generator=gen)
        tokens = train[starts + window]                                     # (B, T + 1)
        loss, loads = model_loss(a, p, buffers, tokens[:, :-1], tokens[:, 1:], freqs_cis, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():  # the balancing bias, from this step's loads
            for name, load in loads.items():
                buffers[name] += a.bias_rate * torch.sign(load.float().mean() - load.float())

    blas = loaded_openblas()
    results = []
    for blas_threads in ([threads, 1] if blas and threads > 1 else [None]):
        if blas_threads:
            blas.openblas_set_num_threads(blas_threads)
        for _ in range(a.warmup):
            step()
        steps = a.steps
        if steps <= 0:  # as many as fill --repeat-s, from one more step's time
            t0 = time.perf_counter()
            step()
            steps = max(1, math.ceil(a.repeat_s / (time.perf_counter() - t0)))
        rates = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            rates.append(B * T * steps / (time.perf_counter() - t0))
        results.append((blas_threads, steps, statistics.median(rates), rates))
    return results, sum(t.numel() for t in p.values())


# ----------------------------------------------------------------------------
# the lesson's measurement

def run_lesson(a, threads):
    """Lesson 08 as one process on the cpu: its tokens/s and parameter count."""
    mpirun = shlex.split(os.environ.get("MPIRUN", "mpirun"))
    if "--bind-to" not in mpirun:  # one rank bound to one core would run its threads there
        mpirun += ["--bind-to", "none"]
    steps = a.lesson_steps if a.lesson_steps > 0 else max(20, 25600 // (a.batch * a.seq))
    cmd = mpirun + ["-np", "1", a.lesson, "--device", "cpu", "--train", str(steps),
                    "--check-every", "1000000", "--log-every", "1000000", "--seed", str(a.seed),
                    "--data", a.data]
    for name, _ in MODEL_FLAGS:
        cmd += ["--" + name, str(getattr(a, name.replace("-", "_")))]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rate = re.search(r"^training: [\d.]+ ms per step .*, ([\d.]+) tokens/s$", r.stdout, re.M)
    count = re.search(r"; (\d+) parameters", r.stdout)
    if r.returncode != 0 or not rate or not count:
        sys.stdout.write(r.stdout)
        sys.exit(f"bench_08: {' '.join(cmd)} failed (exit {r.returncode}) or printed no "
                 "'training: ... tokens/s' line")
    return float(rate.group(1)), int(count.group(1))


def main():
    a = parse_args()
    size = f"d {a.dim}, batch {a.batch} x {a.seq} tokens"
    thread_text = f"{THREADS} thread{'s' if THREADS > 1 else ''}"
    if a.lesson:
        ours, ours_params = run_lesson(a, THREADS)
    results, params = bench_torch(a, THREADS)
    blas = loaded_openblas()
    core = blas.openblas_get_corename().decode() if blas else "not OpenBLAS"
    for blas_threads, steps, median, rates in results:
        on = f", OpenBLAS ({core}) on {blas_threads}" if blas_threads else ""
        print(f"  PyTorch {torch.__version__}, {size}, {params} parameters, routed experts "
              f"{a.moe}, its ops on {thread_text}{on}: {median:.0f} tokens/s (median of "
              + " ".join(f"{r:.0f}" for r in rates) + f", {steps} steps each)")
    theirs = max(median for _, _, median, _ in results)
    if not a.lesson:
        print(f"lesson 08's model in PyTorch eager float32, one training step, cpu, {size}: "
              f"{theirs:.0f} tokens/s ({thread_text})")
        return
    if ours_params != params:
        sys.exit(f"bench_08: the lesson's model has {ours_params} parameters, PyTorch's {params}")
    # the instruction sets: fivefold's, PyTorch's own ops', its OpenBLAS kernels'
    ours_isa, torch_isa, blas_isa = fair.fivefold_isa(), fair.torch_capability(torch), fair.blas_isa(core)
    kernels = f"fivefold {ours_isa}, PyTorch's ops {torch_isa}, OpenBLAS {core} ({blas_isa})"
    ratio = (f"ratio X/Y = {ours / theirs:.2f}" if ours_isa == blas_isa == torch_isa
             else "no ratio: the two sides run different instruction sets")
    print(f"lesson 08: one training step, single process, cpu, {size}: fivefold {ours:.0f} "
          f"tokens/s, PyTorch eager float32 {theirs:.0f} tokens/s (same {thread_text}; kernels: "
          f"{kernels}): {ratio}")


if __name__ == "__main__":
    main()
