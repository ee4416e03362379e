"""make bench's row kernels against PyTorch: the cpu device's softmax family, cross-entropy and
RMSNorm at the shape the lessons use (256 rows of 1024), next to PyTorch eager float32 doing the
same thing on as many threads, timed in the same run.

    /usr/bin/python3 tests/bench/bench_rows.py [--bench build/tests/bench_kernels]

fivefold's figures are bench_kernels --rows-only's medians (kernels/cpu, 1 and 2 threads, each
kernel writing into tensors allocated beforehand); then PyTorch's, each the median of 300 calls
after 50 untimed ones, torch.set_num_threads(1 and 2), timed twice: as eager code calls it
(every call allocates its output and temporaries, 1 MiB each here: the composed RMSNorm's
four measured 10-15 times slower than the same ops into buffers) and, where aten has an out=
form, into buffers allocated beforehand as fivefold's are; the faster of the two is PyTorch's
figure:

    softmax_forward       torch.softmax(x, -1)
    softmax_backward      torch._softmax_backward_data(dy, y, -1, float32)
    log_softmax_forward   torch.log_softmax(x, -1)
    log_softmax_backward  torch._log_softmax_backward_data(dy, y, -1, float32)
    cross_entropy_fwd     F.cross_entropy(x, targets, reduction="none")  (fivefold also keeps lse)
    rmsnorm_forward       x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w, as LLaMA's
                          and DeepSeek-V3's RMSNorm modules write it (this PyTorch has no fused one)

The ratio is PyTorch's time over fivefold's: above 1, fivefold is faster. These kernels are
bound by their exps (or, for RMSNorm and the backwards, by the passes over a row in the cache),
not by memory: bench_kernels' "of memcpy" column says how far each is from streaming its bytes.

Figures only: nothing is asserted about them. The script fails when bench_kernels fails or
prints no figure for a kernel compared here.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fair  # noqa: E402

fair.set_reference_env()  # PyTorch's ops at their best on this CPU, whatever the environment sets

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

N, C = 256, 1024


def fivefold_ms(bench):
    out = subprocess.run([bench, "--rows-only"], check=True, stdout=subprocess.PIPE, text=True).stdout
    ms = {}
    for line in out.splitlines():
        m = re.match(rf"^(\S+)\s+cpu\s+{N}x{C} (\d) thr\s+([0-9.]+) ms", line)
        if m:
            ms[(m.group(1), int(m.group(2)))] = float(m.group(3))
    return ms


def torch_ms(fn):
    for _ in range(50):
        fn()
    times = []
    for _ in range(300):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="build/tests/bench_kernels")
    args = ap.parse_args()
    ours = fivefold_ms(args.bench)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, C, generator=g)
    dy = torch.randn(N, C, generator=g)
    w = torch.randn(C, generator=g)
    targets = torch.randint(0, C, (N,), generator=g)
    y, ly = torch.softmax(x, -1), torch.log_softmax(x, -1)
    out, sq, ms = torch.empty(N, C), torch.empty(N, C), torch.empty(N, 1)
    aten = torch.ops.aten

    def rmsnorm_into():
        torch.mul(x, x, out=sq)
        torch.mean(sq, -1, keepdim=True, out=ms)
        ms.add_(1e-5).rsqrt_()
        torch.mul(x, ms, out=out)
        return out.mul_(w)

    cases = [  # (name, as eager code calls it, into buffers allocated beforehand or None)
        ("softmax_forward", lambda: torch.softmax(x, -1), lambda: aten._softmax.out(x, -1, False, out=out)),
        ("softmax_backward", lambda: torch._softmax_backward_data(dy, y, -1, torch.float32),
         lambda: aten._softmax_backward_data.out(dy, y, -1, torch.float32, grad_input=out)),
        ("log_softmax_forward", lambda: torch.log_softmax(x, -1),
         lambda: aten._log_softmax.out(x, -1, False, out=out)),
        ("log_softmax_backward", lambda: torch._log_softmax_backward_data(dy, ly, -1, torch.float32),
         lambda: aten._log_softmax_backward_data.out(dy, ly, -1, torch.float32, out=out)),
        ("cross_entropy_fwd", lambda: F.cross_entropy(x, targets, reduction="none"), None),
        ("rmsnorm_forward", lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w, rmsnorm_into),
    ]
    # the row kernels run the CPU's best (GCC's function multiversioning, whatever FF_CPU_ISA says)
    ours_isa, torch_isa = fair.cpu_best(), fair.torch_capability(torch)
    same = ours_isa == torch_isa
    print(f"cpu row kernels at {N} x {C}, ms (median): fivefold (kernels/cpu, {ours_isa}) and PyTorch "
          f"{torch.__version__} eager float32 ({torch_isa}) on as many threads; ratio = PyTorch's time / "
          f"fivefold's" + ("" if same else " (none here: not the same instruction set)"))
    print(f"  {'kernel':22s} {'threads':>7s} {'fivefold':>9s} {'PyTorch':>9s} {'ratio':>6s}  "
          f"PyTorch eager / into buffers")
    ratios = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, eager, into in cases:
            if (name, threads) not in ours:
                sys.exit(f"error: {args.bench} --rows-only printed no {name} on {threads} thread(s)")
            both = [torch_ms(eager)] + ([torch_ms(into)] if into else [])
            mine, theirs = ours[(name, threads)], min(both)
            ratios.append(theirs / mine)
            ratio = f"{theirs / mine:6.2f}" if same else f"{'-':>6s}"
            print(f"  {name:22s} {threads:7d} {mine:9.3f} {theirs:9.3f} {ratio}  "
                  + " / ".join(f"{t:.3f}" for t in both))
    if not same:
        print(f"row kernels against PyTorch eager: no ratio: fivefold runs {ours_isa}, PyTorch's ops {torch_isa}")
        return
    print(f"row kernels against PyTorch eager: ratio {min(ratios):.2f} to {max(ratios):.2f} "
          f"(geometric mean {statistics.geometric_mean(ratios):.2f}); both on {ours_isa}")


if __name__ == "__main__":
    main()
