"""Lesson 01 figure, from the lesson's --csv (long format: P,rows,cols,block,series,x,y,y_min,y_max).

Left: the online softmax state of one row as blocks arrive. The running max m jumps when a
block holds a new maximum; at that moment the running normaliser l is rescaled: the whole past
is multiplied by exp(m_old - m_new) before the block's terms are added, so l drops (or grows
less than the block added).
Middle: what is exact — the sequential merge steps on the critical path against the number of
ranks P (series chain_steps and allreduce_steps): the chain takes P-1 hops and then a
broadcast of ceil(log2 P) rounds, one MPI_Allreduce takes ceil(log2 P) rounds.
Right: what was measured — the time to merge the per-rank states (m, l), median over
repetitions with a band from the fastest to the slowest (series chain_us and allreduce_us:
y = median, y_min, y_max), on a log scale. The times are noisy; the step counts are not.

writes OUTDIR/01_online_softmax.png
usage: 01_online_softmax.py CSV OUTDIR
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if len(sys.argv) != 3:
    sys.exit(__doc__.strip().splitlines()[-1])
src, dst = sys.argv[1], f"{sys.argv[2]}/01_online_softmax.png"
series = defaultdict(dict)  # name -> x -> (y, y_min, y_max) (the last run wins for fold_*)
meta = {}
with open(src) as f:
    for row in csv.DictReader(f):
        y = float(row["y"])
        lo = float(row["y_min"]) if row.get("y_min") else y
        hi = float(row["y_max"]) if row.get("y_max") else y
        series[row["series"]][float(row["x"])] = (y, lo, hi)
        meta = row
for need in ("chain_us", "allreduce_us", "chain_steps", "allreduce_steps", "fold_m", "fold_l"):
    if need not in series:
        sys.exit(f"error: {src} has no '{need}' rows; run 01_online_softmax with --csv")

plt.rcParams.update({"font.size": 12, "axes.titlesize": 13, "legend.fontsize": 10.5})
fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(12.8, 7.2), dpi=100,
                                    gridspec_kw={"width_ratios": [1.25, 1, 1]})

# ---- left: the (m, l) recurrence of one row
xs = sorted(series["fold_m"])
ax1.step(xs, [series["fold_m"][x][0] for x in xs], where="post", color="C3", label="running max m")
ax1.set_xlabel(f"columns folded (blocks of {meta['block']})")
ax1.set_ylabel("m (score units)", color="C3")
ax1b = ax1.twinx()
ax1b.plot(xs, [series["fold_l"][x][0] for x in xs], "o-", color="C0", ms=4,
          label="running normaliser l")
ax1b.set_ylabel("l = Σ exp(x − m)  (dimensionless)", color="C0")
for a, b in zip(xs, xs[1:]):
    if series["fold_m"][b][0] > series["fold_m"][a][0]:
        ax1.axvline(b, color="C3", alpha=0.15)
ax1.set_title("online softmax of row 0:\nl is rescaled when m grows")
h1, l1 = ax1.get_legend_handles_labels()
h2, l2 = ax1b.get_legend_handles_labels()
ax1.legend(h1 + h2, l1 + l2, loc="lower right")

# ---- middle: exact sequential merge steps against P
ps = sorted(series["chain_steps"])
ax2.plot(ps, [series["chain_steps"][p][0] for p in ps], "o-", color="C1",
         label="chain: P−1 + ⌈log₂P⌉")
ax2.plot(ps, [series["allreduce_steps"][p][0] for p in ps], "s-", color="C0",
         label="allreduce: ⌈log₂P⌉")
for name, color, dy in (("chain_steps", "C1", 6), ("allreduce_steps", "C0", -15)):
    for p in ps:
        ax2.annotate(f"{series[name][p][0]:.0f}", (p, series[name][p][0]), xytext=(0, dy),
                     textcoords="offset points", ha="center", fontsize=10, color=color)
ax2.set_xlabel("ranks P")
ax2.set_ylabel("merge steps on the critical path (count)")
ax2.set_xticks(ps)
top = max(series["chain_steps"][p][0] for p in ps)
ax2.set_ylim(-1, top + 2)
ax2.set_title("exact: sequential merge steps")
ax2.grid(alpha=0.3)
ax2.legend(loc="upper left")

# ---- right: measured times, median with a min-max band
for name, marker, color, label in (("chain_us", "o-", "C1", "chain + bcast"),
                                   ("allreduce_us", "s-", "C0", "MPI_Allreduce")):
    ps = sorted(series[name])
    med = [series[name][p][0] for p in ps]
    ax3.fill_between(ps, [series[name][p][1] for p in ps], [series[name][p][2] for p in ps],
                     color=color, alpha=0.18, lw=0)
    ax3.plot(ps, med, marker, color=color, label=f"{label} (median)")
ax3.fill_between([], [], [], color="gray", alpha=0.3, label="band: fastest to slowest")
ax3.set_yscale("log")
ax3.set_xlabel("ranks P")
ax3.set_ylabel("merge time (µs, log scale)")
ax3.set_xticks(sorted(series["chain_us"]))
ax3.set_title(f"measured: merge time of {meta['rows']} rows")
ax3.grid(alpha=0.3, which="both")
ax3.legend(loc="lower right")

fig.text(0.5, 0.012, "times measured with mpirun on this machine; ranks beyond its core count "
         "share cores, which inflates and scatters them — the step counts are what the algorithms fix",
         ha="center", fontsize=10, color="dimgray")
fig.tight_layout(rect=(0, 0.035, 1, 1))
fig.savefig(dst)
print(f"wrote {dst}")
