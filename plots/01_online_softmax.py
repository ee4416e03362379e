"""Lesson 01 figure, from the lesson's --csv (long format: P,rows,cols,block,series,x,y).

Left: the online softmax state of one row as blocks arrive. The running max m jumps when a
block holds a new maximum; at that moment the running normaliser l *drops*, because the
whole past is rescaled by exp(m_old - m_new) before the block's terms are added.
Right: time to merge the per-rank states (m, l) against the number of ranks P: the chain
(P-1 sequential hops, then a broadcast) against one MPI_Allreduce with a user-defined op.

usage: 01_online_softmax.py CSV PNG
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
series = defaultdict(dict)  # name -> x -> y (the last run wins for fold_*)
meta = {}
with open(src) as f:
    for row in csv.DictReader(f):
        series[row["series"]][float(row["x"])] = float(row["y"])
        meta = row
for need in ("chain_us", "allreduce_us", "fold_m", "fold_l"):
    if need not in series:
        sys.exit(f"error: {src} has no '{need}' rows; run 01_online_softmax with --csv")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=150)

xs = sorted(series["fold_m"])
ax1.step(xs, [series["fold_m"][x] for x in xs], where="post", color="C3", label="running max m")
ax1.set_xlabel(f"columns folded (blocks of {meta['block']})")
ax1.set_ylabel("m", color="C3")
ax1b = ax1.twinx()
ax1b.plot(xs, [series["fold_l"][x] for x in xs], "o-", color="C0", ms=3,
          label="running normaliser l")
ax1b.set_ylabel("l = sum exp(x - m)", color="C0")
for a, b in zip(xs, xs[1:]):
    if series["fold_m"][b] > series["fold_m"][a]:
        ax1.axvline(b, color="C3", alpha=0.15)
ax1.set_title("online softmax of row 0: l is rescaled when m grows")
h1, l1 = ax1.get_legend_handles_labels()
h2, l2 = ax1b.get_legend_handles_labels()
ax1.legend(h1 + h2, l1 + l2, loc="center right", fontsize=8)

style = {"chain_us": ("o-", "C1", "chain r-1 -> r -> r+1, then bcast: O(P)"),
         "allreduce_us": ("s-", "C0", "MPI_Allreduce, user-defined op: O(log P)")}
for name, (marker, color, label) in style.items():
    ps = sorted(series[name])
    ax2.plot(ps, [series[name][p] for p in ps], marker, color=color, label=label)
ax2.set_xlabel("ranks P")
ax2.set_ylabel("merge time, median (µs)")
ax2.set_xticks(sorted(series["chain_us"]))
ax2.set_title(f"merging (m, l) of {meta['rows']} rows across ranks")
ax2.grid(alpha=0.3)
ax2.legend(fontsize=8)
fig.text(0.5, 0.01, "times measured with mpirun on this machine; ranks beyond its core count "
         "share cores, which inflates and scatters them", ha="center", fontsize=7, color="gray")
fig.tight_layout(rect=(0, 0.03, 1, 1))
fig.savefig(dst)
print(f"wrote {dst}")
