"""Lesson 02 figures.

02_ring_work.png, from the lesson's --csv (P,S,causal,layout,rank,entries): the score entries
each rank computes under the causal mask, for the three layouts. Contiguous blocks leave the
first rank almost idle and the last one with most of the triangle; zigzag (chunks r and
2P-1-r) and striped (token t on rank t mod P) give every rank the same share.

02_ring_timeline.png, from two --trace files (Chrome trace JSON): per rank, the compute spans
(one per K/V block folded, "X" events on the compute track) and, on the comm track, two things
apart: solid, the time the rank sat blocked in a call ("X" events: ssend, recv, wait_all,
allreduce), and hatched, the time a nonblocking message was in flight, from isend/irecv to its
completion (async "b"/"e" pairs). --order evenodd (send, receive, then compute) has only blocked
time: each message travels while its rank waits. --order async posts the next block's
isend/irecv before computing on the current one: messages fly under the compute and the rank
blocks only for what is left of the flight. Both panels share one time axis.

Both figures are 1280x720.

usage: 02_ring_attention.py WORK_CSV TRACE_EVENODD TRACE_ASYNC OUT_DIR
"""
import csv
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

if len(sys.argv) != 5:
    sys.exit(__doc__.strip().splitlines()[-1])
work_csv, trace_sync, trace_async, out = sys.argv[1:5]
plt.rcParams.update({"font.size": 12, "axes.titlesize": 13, "legend.fontsize": 11})

# ---- per-rank work
work = defaultdict(dict)  # layout -> rank -> entries
meta = None
with open(work_csv) as f:
    for row in csv.DictReader(f):
        work[row["layout"]][int(row["rank"])] = int(row["entries"])
        meta = row
if not work:
    sys.exit(f"error: {work_csv} has no rows; run 02_ring_attention with --csv")
layouts = [l for l in ("contiguous", "zigzag", "striped") if l in work]
P = int(meta["P"])
fig, ax = plt.subplots(figsize=(12.8, 7.2), dpi=100)
width = 0.8 / len(layouts)
for i, layout in enumerate(layouts):
    ys = [work[layout].get(r, 0) for r in range(P)]
    peak = max(ys) * P / sum(ys)
    ax.bar([r + (i - (len(layouts) - 1) / 2) * width for r in range(P)], ys, width,
           label=f"{layout} (max/mean {peak:.2f})")
ax.set_xticks(range(P))
ax.set_xticklabels([f"rank {r}" for r in range(P)])
ax.set_ylabel("score entries computed (count of 16x16 tiles)")
ax.set_title(f"Ring attention, {'causal' if meta['causal'] == '1' else 'non-causal'}, "
             f"S={meta['S']}, P={P}: work per rank")
ax.legend()
fig.tight_layout()
fig.savefig(f"{out}/02_ring_work.png")


# ---- timelines
def load_trace(path):
    """(blocked, flights, compute): per rank, [(start_us, duration_us)]."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    compute, blocked, flights = defaultdict(list), defaultdict(list), defaultdict(list)
    begun = {}  # (pid, id) -> ts of the "b" event
    for e in events:
        ph = e.get("ph")
        if ph == "X":
            track = compute if threads.get((e["pid"], e["tid"])) == "compute" else blocked
            track[e["pid"]].append((e["ts"], e["dur"]))
        elif ph == "b":
            begun[(e["pid"], e["id"])] = e["ts"]
        elif ph == "e" and (e["pid"], e["id"]) in begun:
            start = begun.pop((e["pid"], e["id"]))
            flights[e["pid"]].append((start, e["ts"] - start))
    return blocked, flights, compute


def covered(spans):
    """Time covered by the union of [(start, duration)] (overlapping flights count once)."""
    total, end = 0.0, float("-inf")
    for start, dur in sorted(spans):
        total += max(0.0, start + dur - max(start, end))
        end = max(end, start + dur)
    return total


traces = [(trace_sync, "--order evenodd: send, receive, then compute"),
          (trace_async, "--order async: isend/irecv of the next block posted before the compute")]
loaded = [load_trace(path) for path, _ in traces]
fig, axes = plt.subplots(2, 1, figsize=(12.8, 7.2), dpi=100, sharex=True)
BLOCKED, FLIGHT, COMPUTE = "#b2182b", "#f4a6a6", "C0"
for ax, (blocked, flights, compute), (_, title) in zip(axes, loaded, traces):
    tracks = (compute, blocked, flights)
    t0 = min(start for track in tracks for v in track.values() for start, _ in v)
    ms = lambda v: [((start - t0) / 1e3, dur / 1e3) for start, dur in v]
    ranks = sorted(set(compute) | set(blocked) | set(flights))
    ticks, labels = [], []
    for i, r in enumerate(ranks):
        y = i * 2.6
        ax.broken_barh(ms(compute.get(r, [])), (y - 0.4, 0.8), color=COMPUTE)
        ax.broken_barh(ms(flights.get(r, [])), (y + 1 - 0.4, 0.8), facecolor=FLIGHT,
                       edgecolor=BLOCKED, hatch="///", lw=0)
        ax.broken_barh(ms(blocked.get(r, [])), (y + 1 - 0.25, 0.5), color=BLOCKED)
        ticks += [y, y + 1]
        labels += [f"rank {r} compute", f"rank {r} comm"]
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=9.5)
    ax.invert_yaxis()
    total = lambda track: sum(covered(v) for v in track.values()) / 1e3 / max(len(ranks), 1)
    flown = (f"some message in flight {total(flights):.1f} ms" if flights else
             "messages travel only inside blocking calls")
    ax.set_title(f"{title}\nmean per rank: blocked {total(blocked):.1f} ms, {flown}, "
                 f"compute {total(compute):.1f} ms", loc="left", fontsize=12)
axes[-1].set_xlabel("time since the ring started (ms)")
fig.legend(handles=[Patch(color=COMPUTE, label="compute (one K/V block)"),
                        Patch(color=BLOCKED, label="blocked in a call (ssend, recv, wait, allreduce)"),
                        Patch(facecolor=FLIGHT, edgecolor=BLOCKED, hatch="///", lw=0,
                              label="message in flight (isend/irecv to completion)")],
           loc="lower center", fontsize=10.5, ncol=3, frameon=False)
fig.tight_layout(rect=(0, 0.045, 1, 1))
fig.savefig(f"{out}/02_ring_timeline.png")
print(f"wrote {out}/02_ring_work.png and {out}/02_ring_timeline.png")
