"""Lesson 04 figures.

04_gshard.png, two panels:
  left   the rank -> rank token traffic of one dispatch (from `04_gshard --csv`, series
         traffic: a = source rank, b = destination rank, c = routing slots sent). The diagonal
         is the local copy; everything else crosses the network, twice forward, twice backward.
  right  all-to-all time per implementation against the block size per peer (from
         `04_gshard --bench --csv`, series a2a: P, bytes, impl, us = median over repetitions,
         us_min, us_max), as the ratio to MPI_Alltoallv's median on a log axis: a line through
         the ratio of medians, error bars from the implementation's fastest to its slowest
         repetition (each divided by the library's median), so one unstable repetition lengthens
         a bar instead of rescaling the axis.

usage: 04_gshard.py TRAFFIC_CSV BENCH_CSV OUT_DIR
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import (FixedLocator, FormatStrFormatter, NullFormatter,  # noqa: E402
                               NullLocator)

if len(sys.argv) != 4:
    sys.exit(__doc__.strip().splitlines()[-1])
traffic_csv, bench_csv, out = sys.argv[1:4]
traffic = {}
with open(traffic_csv) as f:
    for row in csv.DictReader(f):
        if row["series"] == "traffic":
            traffic[(int(row["a"]), int(row["b"]))] = int(row["c"])
            meta = row
if not traffic:
    sys.exit(f"error: {traffic_csv} has no traffic rows; run 04_gshard with --csv")
P = max(a for a, _ in traffic) + 1
times = defaultdict(dict)  # (P, impl) -> bytes -> (median, min, max) in us
with open(bench_csv) as f:
    for row in csv.DictReader(f):
        if row["series"] != "a2a":
            continue
        us = float(row["us"])
        times[(int(row["P"]), row["impl"])][int(row["bytes"])] = (
            us, float(row.get("us_min") or us), float(row.get("us_max") or us))
if not times:
    sys.exit(f"error: {bench_csv} has no a2a rows; run 04_gshard --bench --csv")

plt.rcParams.update({"font.size": 12, "axes.titlesize": 13, "legend.fontsize": 10.5})
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12.8, 7.2), dpi=100,
                               gridspec_kw={"width_ratios": [1, 1.25]})
m = [[traffic.get((a, b), 0) for b in range(P)] for a in range(P)]
im = ax1.imshow(m, cmap="Blues")
for a in range(P):
    for b in range(P):
        ax1.text(b, a, m[a][b], ha="center", va="center",
                 color="white" if m[a][b] > max(map(max, m)) * 0.6 else "black")
ax1.set_xticks(range(P))
ax1.set_yticks(range(P))
ax1.set_xlabel("destination rank (holds the experts)")
ax1.set_ylabel("source rank (holds the tokens)")
ax1.set_title(f"dispatch traffic, N={meta['N']}, top-{meta['k']}")
fig.colorbar(im, ax=ax1, shrink=0.7, label="routing slots sent (tokens × choices)")

STYLE = {"ordered": ("o", "-"), "async": ("s", "--")}  # impl -> (marker, line)
curves = [(p, impl) for p, impl in sorted(times) if impl != "library"]
all_bytes = sorted({b for v in times.values() for b in v})
for i, (p, impl) in enumerate(curves):
    series, lib = times[(p, impl)], times.get((p, "library"), {})
    xs = sorted(b for b in series if b in lib)
    if not xs:
        continue
    marker, line = STYLE.get(impl, ("^", "-."))
    shift = 2 ** ((i - (len(curves) - 1) / 2) * 0.18)  # side by side so the bars do not hide each other
    med = [series[b][0] / lib[b][0] for b in xs]
    lo = [m - series[b][1] / lib[b][0] for m, b in zip(med, xs)]
    hi = [series[b][2] / lib[b][0] - m for m, b in zip(med, xs)]
    ax2.errorbar([b * shift for b in xs], med, yerr=[lo, hi], fmt=marker + line, color=f"C{i}",
                 ms=7, capsize=4, elinewidth=1.2, label=f"{impl}, P={p}")
ax2.errorbar([], [], yerr=[], fmt="none", color="gray", capsize=4,
             label="bar: fastest to slowest rep\n(÷ library median)")
ax2.axhline(1.0, color="gray", lw=1)
ax2.set_xscale("log", base=2)
ax2.set_yscale("log")
ax2.set_xticks(all_bytes)
ax2.set_xticklabels([f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB" if b >= 1 << 10
                     else f"{b} B" for b in all_bytes])
ax2.xaxis.set_minor_locator(NullLocator())
ax2.yaxis.set_major_locator(FixedLocator([0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]))
ax2.yaxis.set_major_formatter(FormatStrFormatter("%g"))
ax2.yaxis.set_minor_formatter(NullFormatter())
ax2.set_xlabel("bytes per peer block (log scale)")
ax2.set_ylabel("time / MPI_Alltoallv time (ratio of medians, log scale)")
ax2.set_title("hand-written all-to-all vs the library")
ax2.grid(alpha=0.3)
ax2.legend(loc="upper right")
fig.text(0.5, 0.012, "below 1: faster than MPI_Alltoallv; times from mpirun on this machine, "
         "median over repetitions", ha="center", fontsize=10, color="dimgray")
fig.tight_layout(rect=(0, 0.035, 1, 1))
fig.savefig(f"{out}/04_gshard.png")
print(f"wrote {out}/04_gshard.png")
