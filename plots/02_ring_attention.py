"""Lesson 02 figures.

02_ring_work.png, from the lesson's --csv (P,S,causal,layout,rank,entries): the score entries
each rank computes under the causal mask, for the three layouts. Contiguous blocks leave the
first rank almost idle and the last one with most of the triangle; zigzag (chunks r and
2P-1-r) and striped (token t on rank t mod P) give every rank the same share.

02_ring_timeline.png, from two --trace files (Chrome trace JSON): per rank, the compute spans
(one per K/V block folded) and the communication spans, for --order evenodd (send, receive,
then compute: the two alternate) and --order async (the next block's isend/irecv posted before
computing on the current one: communication spans overlap compute).

usage: 02_ring_attention.py WORK_CSV TRACE_EVENODD TRACE_ASYNC OUT_DIR
"""
import csv
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

work_csv, trace_sync, trace_async, out = sys.argv[1:5]

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
fig, ax = plt.subplots(figsize=(7, 4), dpi=150)
width = 0.8 / len(layouts)
for i, layout in enumerate(layouts):
    ys = [work[layout].get(r, 0) for r in range(P)]
    peak = max(ys) * P / sum(ys)
    ax.bar([r + (i - (len(layouts) - 1) / 2) * width for r in range(P)], ys, width,
           label=f"{layout} (max/mean {peak:.2f})")
ax.set_xticks(range(P))
ax.set_xticklabels([f"rank {r}" for r in range(P)])
ax.set_ylabel("score entries computed (16x16 tiles)")
ax.set_title(f"Ring attention, {'causal' if meta['causal'] == '1' else 'non-causal'}, "
             f"S={meta['S']}, P={P}: work per rank")
ax.legend()
fig.tight_layout()
fig.savefig(f"{out}/02_ring_work.png")


# ---- timelines
def load_trace(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = defaultdict(list)  # (rank, stream) -> [(start, duration)]
    for e in events:
        if e.get("ph") == "X":
            spans[(e["pid"], threads.get((e["pid"], e["tid"]), "?"))].append((e["ts"], e["dur"]))
    return spans


fig, axes = plt.subplots(2, 1, figsize=(10, 6), dpi=150, sharex=False)
for ax, (path, title) in zip(axes, [(trace_sync, "--order evenodd (synchronous hops)"),
                                    (trace_async, "--order async (isend/irecv before compute)")]):
    spans = load_trace(path)
    t0 = min(start for v in spans.values() for start, _ in v)
    spans = {key: [((start - t0) / 1e3, dur / 1e3) for start, dur in v] for key, v in spans.items()}
    ranks = sorted({r for r, _ in spans})
    ticks, labels = [], []
    for i, r in enumerate(ranks):
        for j, (stream, color) in enumerate([("compute", "C0"), ("comm", "C3")]):
            y = i * 3 + j
            ax.broken_barh(spans.get((r, stream), []), (y - 0.4, 0.8), color=color)
            ticks.append(y)
            labels.append(f"rank {r} {stream}")
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title)
    ax.set_xlabel("time since the ring started (ms)")
fig.tight_layout()
fig.savefig(f"{out}/02_ring_timeline.png")
