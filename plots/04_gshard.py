"""Lesson 04 figures.

04_gshard.png, two panels:
  left   the rank -> rank token traffic of one dispatch (from `04_gshard --csv`, series
         traffic: a = source rank, b = destination rank, c = routing slots sent). The diagonal
         is the local copy; everything else crosses the network, twice forward, twice backward.
  right  all-to-all time per implementation against the block size per peer (from
         `04_gshard --bench --csv`, series a2a), as the ratio to MPI_Alltoallv.

usage: 04_gshard.py TRAFFIC_CSV BENCH_CSV OUT_DIR
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
times = defaultdict(dict)  # (P, impl) -> bytes -> us
with open(bench_csv) as f:
    for row in csv.DictReader(f):
        times[(int(row["P"]), row["impl"])][int(row["bytes"])] = float(row["us"])

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.3), dpi=150)
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
ax1.set_title(f"dispatch traffic: routing slots, N={meta['N']}, top-{meta['k']}")
fig.colorbar(im, ax=ax1, shrink=0.8)

for (p, impl), series in sorted(times.items()):
    if impl == "library":
        continue
    lib = times.get((p, "library"), {})
    xs = sorted(b for b in series if b in lib)
    ax2.plot(xs, [series[b] / lib[b] for b in xs], "o-" if impl == "ordered" else "s--",
             label=f"{impl}, P={p}")
ax2.axhline(1.0, color="gray", lw=1)
ax2.set_xscale("log", base=2)
ax2.set_xlabel("bytes per peer block")
ax2.set_ylabel("time / MPI_Alltoallv")
ax2.set_title("hand-written all-to-all vs the library")
ax2.legend(fontsize=8)
fig.tight_layout()
fig.savefig(f"{out}/04_gshard.png")
