"""The references make bench times against, at their best on this CPU, whatever the environment
sets (imported by bench_08.py and bench_rows.py before torch, whose OpenBLAS and ATen read these
variables when they load):

  * OPENBLAS_CORETYPE: SkylakeX where the CPU has AVX-512 (F, BW, CD, DQ, VL), Haswell where it
    has AVX2 + FMA (+ BMI2, MOVBE), else unset (OpenBLAS's own choice). Debian's OpenBLAS 0.3.21
    falls back to its generic SSE3 kernels on CPU models newer than it knows, and a user's
    OPENBLAS_CORETYPE can pick lower ones (Haswell's on an AVX-512 CPU measured 1.6x slower);
  * OPENBLAS_L2_SIZE cleared;
  * ATEN_CPU_CAPABILITY (PyTorch's own ops): avx512 on an AVX-512 CPU, else cleared.
With FF_CPU_ISA=avx2 (make bench's labelled AVX2 rows on an AVX-512 CPU) both sides run AVX2:
Haswell's kernels, ATEN_CPU_CAPABILITY=avx2. The benches print the instruction set each side runs
(same_isa) and give no ratio where they differ.
"""
import os
import re


def cpu_best():
    """The best instruction set of this CPU, in the benches' words: AVX-512, AVX2 or portable."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith("flags")]
    except OSError:
        return "portable"
    flags = set(lines[0].split(":", 1)[1].split()) if lines else set()
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        return "AVX-512"
    if {"avx2", "fma", "bmi2", "movbe"} <= flags:
        return "AVX2"
    return "portable"


AVX2_ONLY = os.environ.get("FF_CPU_ISA") == "avx2"
CORETYPE = {"AVX-512": "SkylakeX", "AVX2": "Haswell"}


def set_reference_env():
    for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "ATEN_CPU_CAPABILITY"):
        os.environ.pop(name, None)
    best = "AVX2" if AVX2_ONLY else cpu_best()
    if best in CORETYPE:
        os.environ["OPENBLAS_CORETYPE"] = CORETYPE[best]
    if AVX2_ONLY or best == "AVX-512":
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2" if AVX2_ONLY else "avx512"


def fivefold_isa():
    """What fivefold's cpu matmul runs: FF_CPU_ISA's level, else the CPU's best."""
    want = os.environ.get("FF_CPU_ISA", "best")
    return {"avx2": "AVX2", "portable": "portable"}.get(want, cpu_best())


def blas_isa(core):
    """The instruction set of an OpenBLAS core's kernels."""
    return {"SkylakeX": "AVX-512", "Cooperlake": "AVX-512", "SapphireRapids": "AVX-512",
            "Haswell": "AVX2", "Zen": "AVX2"}.get(core, "older than AVX2")


def torch_capability(torch):
    """The instruction set PyTorch's own ops dispatch to ("CPU capability usage: AVX2" in
    torch.__config__.show())."""
    m = re.search(r"CPU capability usage: (\S+)", torch.__config__.show())
    cap = m.group(1) if m else "unknown"
    return {"AVX512": "AVX-512", "AVX2": "AVX2", "DEFAULT": "portable"}.get(cap, cap)
