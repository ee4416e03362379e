"""Lesson 01 figure: time to merge the per-rank online-softmax states (m, l) against the
number of ranks P, for the chain (P-1 sequential hops, then a broadcast) and for one
MPI_Allreduce with a user-defined op (a tree: about log2 P steps).

usage: 01_online_softmax.py CSV PNG   (CSV from `01_online_softmax --csv`, one run per P)
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
times = defaultdict(dict)  # method -> P -> median us
shape = None
with open(src) as f:
    for row in csv.DictReader(f):
        times[row["method"]][int(row["P"])] = float(row["median_us"])
        shape = (row["rows"], row["cols"])
if not times:
    sys.exit(f"error: no rows in {src}")

fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=150)
style = {"chain": ("o-", "chain: r-1 -> r -> r+1, then bcast  (O(P))"),
         "allreduce": ("s-", "MPI_Allreduce, user-defined op  (O(log P))")}
for method, series in sorted(times.items()):
    ps = sorted(series)
    marker, label = style.get(method, ("x-", method))
    ax.plot(ps, [series[p] for p in ps], marker, label=label)
ax.set_xlabel("ranks P")
ax.set_ylabel("merge time, median over repetitions (µs)")
ax.set_title(f"Merging online-softmax states (m, l) of a {shape[0]}x{shape[1]} x")
ax.set_xticks(sorted({p for s in times.values() for p in s}))
ax.grid(alpha=0.3)
ax.legend()
fig.text(0.01, 0.01, "measured with mpirun on this machine; ranks beyond the core count share cores",
         fontsize=7, color="gray")
fig.tight_layout(rect=(0, 0.03, 1, 1))
fig.savefig(dst)
print(f"wrote {dst}")
