"""Lesson 06's figures, from its traces and --csv output (scripts/make-plots.sh runs it first).

usage: 06_overlap.py SEQ_TRACE OVL_TRACE SWEEP_CSV PROGRESS_CSV OUTDIR
  SEQ_TRACE, OVL_TRACE  Chrome traces (--trace) of one --mode sequential and one --mode
             overlapped run at P = 4: compute spans ("F3 experts", "B2 attn", "W") on the compute
             track, message flights (async events) on the comm track
  SWEEP_CSV  rows `mode,rank,progress,inter_MBps,intra_MBps,wall_ms,compute_ms,wait_ms` of runs
             (mode: sequential, overlapped-w-inline, overlapped-w-in-waits)
             at several inter-node bandwidths (--link), --progress test
  PROGRESS_CSV  the same rows for --progress none, test and thread at the default network
writes OUTDIR/06_overlap_timeline.png (compute and messages per rank, sequential above
overlapped, one time axis), 06_overlap_bandwidth.png (hidden fraction and walls against the
inter-node bandwidth) and 06_overlap_progress.png (walls per progress mode)."""
import csv
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

if len(sys.argv) != 6:
    sys.exit(__doc__)
seq_trace, ovl_trace, sweep_csv, progress_csv, out = sys.argv[1:]
plt.rcParams.update({"font.size": 15, "axes.titlesize": 17, "axes.labelsize": 15,
                     "legend.fontsize": 13, "xtick.labelsize": 13, "ytick.labelsize": 13})
FIG = dict(figsize=(12.8, 7.2), dpi=100)
COLOR = {"F": "#4c72b0", "B": "#dd8452", "W": "#8c8c8c", "msg": "#55a868"}


def load_trace(path):
    """Per rank: compute spans (kind, start, end) and flights (start, end), in ms from the first
    compute span of the last run in the trace (the trace holds every repetition: the last one)."""
    events = json.load(open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    track = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    compute, flights, begins = defaultdict(list), defaultdict(list), {}
    for e in events:
        name = track.get((e.get("pid"), e.get("tid")))
        if e.get("ph") == "X" and name == "compute":
            compute[e["pid"]].append((e["name"][0], e["ts"], e["ts"] + e["dur"]))
        elif e.get("ph") == "b" and name == "comm":
            begins[(e["pid"], e["id"])] = e["ts"]
        elif e.get("ph") == "e" and name == "comm" and (e["pid"], e["id"]) in begins:
            flights[e["pid"]].append((begins.pop((e["pid"], e["id"])), e["ts"]))
    t0 = min(s for spans in compute.values() for _, s, _ in spans)
    return ({r: [(k, (a - t0) / 1e3, (b - t0) / 1e3) for k, a, b in v] for r, v in compute.items()},
            {r: [((a - t0) / 1e3, (b - t0) / 1e3) for a, b in v] for r, v in flights.items()})


# ---- the timelines: per rank a compute row and a message row, sequential above overlapped
fig, axes = plt.subplots(2, 1, **FIG, sharex=True)
for ax, path, title in ((axes[0], seq_trace, "sequential: every all-to-all waited for at once"),
                        (axes[1], ovl_trace, "overlapped: F(i) and B(i-1) interleaved, W in the waits")):
    compute, flights = load_trace(path)
    ranks = sorted(compute)
    for i, r in enumerate(ranks):
        y = (len(ranks) - 1 - i) * 3
        ax.broken_barh([(a, b - a) for k, a, b in compute[r]], (y + 1.1, 0.8),
                       facecolors=[COLOR[k] for k, _, _ in compute[r]])
        ax.broken_barh([(a, b - a) for a, b in flights.get(r, [])], (y + 0.2, 0.8),
                       facecolors=COLOR["msg"], alpha=0.35)
    ax.set_yticks([(len(ranks) - 1 - i) * 3 + 1 for i in range(len(ranks))])
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    end = max(b for spans in compute.values() for _, _, b in spans)
    ax.set_title(f"{title} ({end:.0f} ms)")
axes[1].set_xlabel("ms (modelled compute and network)")
fig.legend(handles=[Patch(color=COLOR["F"], label="forward"), Patch(color=COLOR["B"], label="backward (input)"),
                    Patch(color=COLOR["W"], label="weight gradients"),
                    Patch(color=COLOR["msg"], alpha=0.35, label="a message in flight")],
           loc="upper center", bbox_to_anchor=(0.5, 0.945), ncol=4, frameon=False)
fig.suptitle("Lesson 06: 1F1B on one stage, P = 4: compute and all-to-alls per rank", y=0.99)
fig.tight_layout(rect=(0, 0, 1, 0.9))
fig.savefig(f"{out}/06_overlap_timeline.png")
plt.close(fig)


def by_mode(rows):
    """{(key, mode): [rows of the ranks]}"""
    d = defaultdict(list)
    for r in rows:
        d[r["mode"]].append(r)
    return d


def hidden(seq, ovl):
    """Per rank (T_seq - T_ovl) / min(T_compute, T_comm) of the sequential run."""
    out = []
    for s, o in zip(sorted(seq, key=lambda r: int(r["rank"])), sorted(ovl, key=lambda r: int(r["rank"]))):
        hide = min(float(s["compute_ms"]), float(s["wait_ms"]))
        out.append((float(s["wall_ms"]) - float(o["wall_ms"])) / hide if hide > 0 else 0.0)
    return out


# ---- hidden fraction and walls against the inter-node bandwidth
rows = list(csv.DictReader(open(sweep_csv)))
bws = sorted({float(r["inter_MBps"]) for r in rows})
OVL, INLINE = "overlapped-w-in-waits", "overlapped-w-inline"
fig, (ax1, ax2) = plt.subplots(1, 2, **FIG)
worst, mean, walls = [], [], defaultdict(list)
for bw in bws:
    m = by_mode([r for r in rows if float(r["inter_MBps"]) == bw])
    h = hidden(m["sequential"], m[OVL])
    worst.append(100 * min(h))
    mean.append(100 * sum(h) / len(h))
    for mode in ("sequential", INLINE, OVL):
        walls[mode].append(max(float(r["wall_ms"]) for r in m[mode]))
    walls["compute"].append(max(float(r["compute_ms"]) for r in m["sequential"]))
ax1.plot(bws, mean, "o-", label="mean over ranks")
ax1.plot(bws, worst, "s--", label="worst rank")
ax1.axhline(80, color="k", lw=1, ls=":")
ax1.set_xscale("log")
ax1.set_xlabel("inter-node bandwidth, MB/s (intra-node 3.2x)")
ax1.set_ylabel("hidden fraction, %")
ax1.set_title("of the hideable communication, hidden")
ax1.legend()
LABEL = {"sequential": "sequential", INLINE: "overlapped, W inline", OVL: "overlapped, W in the waits",
         "compute": "compute alone (sequential)"}
for mode, style in (("sequential", "o-"), (INLINE, "^-"), (OVL, "s-"), ("compute", "k:")):
    ax2.plot(bws, walls[mode], style, label=LABEL[mode])
ax2.set_xscale("log")
ax2.set_xlabel("inter-node bandwidth, MB/s (intra-node 3.2x)")
ax2.set_ylabel("ms, slowest rank")
ax2.set_title("wall time of the whole 1F1B run")
ax2.legend()
fig.suptitle("Lesson 06: the overlap against the inter-node bandwidth (P = 4, --progress test)")
fig.tight_layout()
fig.savefig(f"{out}/06_overlap_bandwidth.png")
plt.close(fig)

# ---- the progress modes
rows = list(csv.DictReader(open(progress_csv)))
modes = [p for p in ("none", "test", "thread") if any(r["progress"] == p for r in rows)]
fig, ax = plt.subplots(**FIG)
kinds = ("sequential", INLINE, OVL)
width = 0.8 / len(kinds)
for j, kind in enumerate(kinds):
    vals = [max(float(r["wall_ms"]) for r in rows if r["progress"] == p and r["mode"] == kind) for p in modes]
    xs = [i + (j - (len(kinds) - 1) / 2) * width for i in range(len(modes))]
    ax.bar(xs, vals, width, label=LABEL[kind])
    for x, v in zip(xs, vals):
        ax.text(x, v, f"{v:.0f}", ha="center", va="bottom")
for i, p in enumerate(modes):
    m = by_mode([r for r in rows if r["progress"] == p])
    h = hidden(m["sequential"], m[OVL])
    ax.text(i, 0.5 * max(float(r["wall_ms"]) for r in rows), f"hidden\n{100 * min(h):.0f}% (worst)\n"
            f"{100 * sum(h) / len(h):.0f}% (mean)", ha="center", fontsize=13,
            bbox=dict(facecolor="white", alpha=0.8))
ax.set_xticks(range(len(modes)))
ax.set_xticklabels([{"none": "none: data moves\nin the waits", "test": "test: MPI_Test\nbetween tiles",
                     "thread": "thread: a progress\nthread polls"}[p] for p in modes])
ax.set_ylabel("ms, slowest rank")
ax.set_ylim(0, 1.25 * max(float(r["wall_ms"]) for r in rows))
ax.set_title("Lesson 06: MPI progress decides whether the messages move while the rank computes (P = 4)")
ax.legend(loc="upper center", ncol=3)
fig.tight_layout()
fig.savefig(f"{out}/06_overlap_progress.png")
plt.close(fig)
