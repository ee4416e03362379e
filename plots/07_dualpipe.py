"""Lesson 07 figures.

07_gantt.png (1280x720), from executed span CSVs (07_dualpipe --compute sleep --csv FILE: rank, name,
stream, start_us, end_us, bytes): one Gantt chart per schedule, gpipe, 1f1b, zb-h1, dualpipe and
dualpipev at P = 4, M = 8, and dualpipe at P = 8, M = 16. One row per rank, time in ms since the
first op started; each compute span is a box coloured by its kind, F (forward), B (backward),
I (backward for the input only) or W (the deferred weight gradients), labelled with its
micro-batch. An overlapped DualPipe pair "F0(3)&B1(1)" is one split box: its forward on top,
its backward below. Light shades are DualPipe's direction 1 (micro-batches entering at the last
rank) and DualPipeV's second stage on the rank (the up leg of the V). Idle time is white; the
thin grey line inside it is the rank blocked in a receive. Each title gives the measured bubble
ratio, the largest over ranks of (makespan - busy) / makespan, where the makespan runs from the
first compute start to the last compute end over all ranks and busy is the sum of the rank's
compute spans; the right-hand column gives each rank's own ratio. The five P = 4 panels share one time axis
(the longest makespan among them), so their lengths compare at a glance; a dashed line marks each
panel's own makespan. The P = 8 panel has its own axis. The figure's title gives the op costs as
the runs show them (median duration of each kind, in units of F's).

07_bubble.png (1280x720), from the simulator's CSV (07_dualpipe --simulate --csv FILE: schedule, P, M,
makespan, bubble, ratio; P = 8, M = 8..64) and the executed span CSVs at P = 8: the bubble ratio
against the number of micro-batches M, a line per schedule from the simulator and a marker per
executed run (same measure as the Gantt titles), same colour per schedule; the schedule legend
shows each schedule's line and marker, a second legend says line = simulator, marker = executed. At the lesson's
default costs gpipe and 1f1b have the same bubble, and zb-h1 and dualpipev the same ratio
(dualpipev's bubble is twice zb-h1's over twice the work): those pairs of lines lie on each other
(drawn thick and dashed).

RUNS_DIR holds the span CSVs, named 07_<schedule>_P<P>_M<M>.csv (e.g. 07_zb-h1_P8_M24.csv);
the Gantt needs the six runs above, the bubble figure uses every P = 8 run it finds.

usage: 07_dualpipe.py SIM_CSV RUNS_DIR OUT_DIR
"""
import csv
import os
import re
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from matplotlib.ticker import PercentFormatter  # noqa: E402

if len(sys.argv) != 4:
    sys.exit(__doc__.strip().splitlines()[-1])
sim_csv, runs_dir, out = sys.argv[1:4]

SCHEDULES = ["gpipe", "1f1b", "zb-h1", "dualpipe", "dualpipev"]
# per kind: (direction 0 / first stage, direction 1 / second stage) colours
KIND_COLORS = {
    "F": ("#1f77b4", "#aec7e8"),
    "B": ("#2ca02c", "#98df8a"),
    "I": ("#e6750a", "#ffc58f"),
    "W": ("#8458b3", "#cdb6e3"),
}
SCHED_COLORS = {"gpipe": "#7f7f7f", "1f1b": "#1f77b4", "zb-h1": "#ff7f0e", "zb-h2": "#9467bd",
                "dualpipe": "#d62728", "dualpipev": "#2ca02c"}
OP_RE = re.compile(r"^([FBIW])(\d+)\((\d+)\)$")
RUN_RE = re.compile(r"^07_([a-z0-9-]+)_P(\d+)_M(\d+)\.csv$")


def parse_op(name):
    """'F0(3)' -> [('F', 0, 3)]; 'F0(3)&B1(1)' -> [('F', 0, 3), ('B', 1, 1)]."""
    ops = []
    for part in name.split("&"):
        m = OP_RE.match(part)
        if not m:
            raise ValueError(f"unexpected op name {name!r}")
        ops.append((m.group(1), int(m.group(2)), int(m.group(3))))
    return ops


def load_run(path):
    """Returns (compute, recv): per rank, [(start_ms, end_ms, name)], times since the first op."""
    compute, recv = defaultdict(list), defaultdict(list)
    with open(path) as f:
        for row in csv.DictReader(f):
            span = (float(row["start_us"]) / 1e3, float(row["end_us"]) / 1e3, row["name"])
            if row["stream"] == "compute":
                compute[int(row["rank"])].append(span)
            elif row["stream"] == "comm" and row["name"] == "recv":
                recv[int(row["rank"])].append(span)
    if not compute:
        sys.exit(f"error: {path} has no compute spans; run 07_dualpipe with --csv")
    t0 = min(s for v in compute.values() for s, _, _ in v)
    shift = lambda spans: {r: sorted((s - t0, e - t0, n) for s, e, n in v) for r, v in spans.items()}
    return shift(compute), shift(recv)


def bubbles(compute):
    """(makespan_ms, {rank: (makespan - busy) / makespan})."""
    makespan = max(e for v in compute.values() for _, e, _ in v)  # spans start at 0
    return makespan, {r: (makespan - sum(e - s for s, e, _ in v)) / makespan for r, v in compute.items()}


def text_color(hex_color):
    r, g, b = (int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.6 else "black"


runs = {}  # (schedule, P, M) -> path
for fn in sorted(os.listdir(runs_dir)):
    m = RUN_RE.match(fn)
    if m:
        runs[(m.group(1), int(m.group(2)), int(m.group(3)))] = os.path.join(runs_dir, fn)

# ---- Gantt charts
PANELS = [("gpipe", 4, 8), ("1f1b", 4, 8), ("zb-h1", 4, 8),
          ("dualpipe", 4, 8), ("dualpipev", 4, 8), ("dualpipe", 8, 16)]
missing = [f"07_{s}_P{p}_M{m}.csv" for s, p, m in PANELS if (s, p, m) not in runs]
if missing:
    sys.exit(f"error: {runs_dir} lacks {', '.join(missing)}; run 07_dualpipe --compute sleep --csv")


durations = defaultdict(list)  # kind ("F", "B", "I", "W", "F&B") -> [ms], for the title


def draw_gantt(ax, schedule, P, M, run, xmax):
    """One panel; the time axis runs from 0 to xmax ms (shared by the panels that compare)."""
    compute, recv = run
    for v in compute.values():
        for s, e, name in v:
            durations["F&B" if "&" in name else name[0]].append(e - s)
    makespan, ratio = bubbles(compute)
    H = 0.8  # box height; row r is centred on y = r
    label_w = xmax / 60  # narrowest box (ms) that gets a label
    for r in range(P):
        for s, e, _ in recv.get(r, []):
            s, e = max(s, 0.0), min(e, makespan)
            if e > s:
                ax.add_patch(Rectangle((s, r - 0.05), e - s, 0.1, color="#9a9a9a", lw=0))
        for s, e, name in compute.get(r, []):
            ops = parse_op(name)
            h = H / len(ops)
            for i, (kind, d, mb) in enumerate(ops):
                color = KIND_COLORS[kind][min(d, 1)]
                y = r - H / 2 + i * h
                ax.add_patch(Rectangle((s, y), e - s, h, facecolor=color, edgecolor="white", lw=0.6))
                if e - s >= label_w:
                    ax.text((s + e) / 2, y + h / 2, str(mb), ha="center", va="center",
                            fontsize=8 if len(ops) == 1 else 6.5, color=text_color(color))
            if len(ops) > 1:  # outline the pair so that it reads as one op
                ax.add_patch(Rectangle((s, r - H / 2), e - s, H, fill=False, edgecolor="black", lw=0.9))
        ax.text(xmax * 1.01, r, f"{100 * ratio[r]:.0f}%", va="center", fontsize=8.5, color="#444")
    if makespan < xmax * 0.995:
        ax.axvline(makespan, color="#444", lw=1, ls=(0, (3, 2)))
    ax.set_xlim(0, xmax)
    ax.set_ylim(P - 0.5, -0.5)
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"rank {r}" for r in range(P)], fontsize=8.5)
    ax.tick_params(axis="x", labelsize=8.5, pad=1)
    ax.set_xlabel("time (ms)", fontsize=8.5, labelpad=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"{schedule}, P={P}, M={M}: bubble {100 * max(ratio.values()):.1f}%, "
                 f"makespan {makespan:.0f} ms", fontsize=10.5, loc="left", pad=3)


loaded = {panel: load_run(runs[panel]) for panel in PANELS}
# one time axis for the P = 4 panels, so that their makespans compare at a glance
shared = max(bubbles(loaded[panel][0])[0] for panel in PANELS if panel[1] == 4)
fig = plt.figure(figsize=(12.8, 7.2), dpi=100)
outer = fig.add_gridspec(1, 2, wspace=0.2, left=0.055, right=0.965, top=0.905, bottom=0.055)
# rows of ranks: the left column (3 panels of 4 ranks and the legend) and the right one (4, 4, 8)
left = outer[0].subgridspec(4, 1, hspace=0.85)
right = outer[1].subgridspec(3, 1, height_ratios=[4, 4, 8], hspace=0.85 * 3 / 4)
slots = [left[0], left[1], left[2], right[0], right[1], right[2]]
for slot, (schedule, P, M) in zip(slots, PANELS):
    run = loaded[(schedule, P, M)]
    draw_gantt(fig.add_subplot(slot), schedule, P, M, run,
               shared if P == 4 else bubbles(run[0])[0])
lax = fig.add_subplot(left[3])
lax.axis("off")
handles = [Patch(facecolor=KIND_COLORS[k][0], label=lbl) for k, lbl in
           [("F", "F  forward"), ("B", "B  backward (input + weights)"),
            ("I", "I  backward for the input"), ("W", "W  deferred weight gradients")]]
handles += [Patch(facecolor=KIND_COLORS["F"][0], edgecolor="black", lw=0.9,
                  label="F&B pair (split box: F on top, B below)"),
            Patch(facecolor=KIND_COLORS["F"][1],
                  label="light: dualpipe dir. 1 / dualpipev stage 2"),
            Patch(facecolor="white", edgecolor="#bbbbbb", label="idle (the bubble)"),
            Line2D([], [], color="#9a9a9a", lw=2.5, label="blocked in a receive"),
            Line2D([], [], color="#444", lw=1, ls=(0, (3, 2)), label="makespan (P = 4 share one axis)")]
lax.legend(handles=handles, loc="center", ncol=2, fontsize=8.5, frameon=False,
           columnspacing=1.0, handlelength=1.6,
           title="box label: micro-batch;  right column: each rank's idle / makespan",
           title_fontsize=9)
# the op costs as the runs show them: median duration of each kind, in units of F's
median = lambda v: sorted(v)[len(v) // 2]
unit = median(durations["F"])
costs = ", ".join(f"{k} = {median(durations[k]) / unit:.2g}" for k in ("F", "B", "I", "W", "F&B")
                  if durations[k])
fig.suptitle(f"Pipeline schedules executed on MPI ranks\n(op durations in units of F = {unit:.1f} ms: "
             f"{costs})", fontsize=12.5)
fig.savefig(f"{out}/07_gantt.png")
plt.close(fig)

# ---- bubble ratio vs M at P = 8
sim = defaultdict(list)  # schedule -> [(M, ratio)]
with open(sim_csv) as f:
    for row in csv.DictReader(f):
        if int(row["P"]) == 8:
            sim[row["schedule"]].append((int(row["M"]), float(row["ratio"])))
if not sim:
    sys.exit(f"error: {sim_csv} has no P = 8 rows; run 07_dualpipe --simulate --csv")
measured = defaultdict(list)  # schedule -> [(M, ratio)]
for (schedule, P, M), path in sorted(runs.items()):
    if P == 8:
        measured[schedule].append((M, max(bubbles(load_run(path)[0])[1].values())))

plt.rcParams.update({"font.size": 12, "axes.titlesize": 14, "legend.fontsize": 11})
fig, ax = plt.subplots(figsize=(12.8, 7.2), dpi=100)
names = [s for s in SCHEDULES if s in sim or s in measured]
names += sorted(s for s in set(sim) | set(measured) if s not in names)
# lines that coincide at the default costs: the second of each pair is dashed, on top
STYLE = {"gpipe": dict(lw=5, alpha=0.45), "1f1b": dict(lw=2, ls=(0, (5, 3))),
         "zb-h1": dict(lw=5, alpha=0.45), "zb-h2": dict(lw=2, ls=(0, (1, 2))),
         "dualpipev": dict(lw=2, ls=(0, (5, 3))),
         "dualpipe": dict(lw=2.2)}
MARKERS = {"gpipe": "o", "1f1b": "s", "zb-h1": "^", "zb-h2": "P", "dualpipe": "D", "dualpipev": "v"}
for i, name in enumerate(names):
    color = SCHED_COLORS.get(name, f"C{i}")
    if name in sim:
        xs, ys = zip(*sorted(sim[name]))
        ax.plot(xs, [100 * y for y in ys], color=color, label=name, **STYLE.get(name, dict(lw=2)))
    if name in measured:
        dx = (i - (len(names) - 1) / 2) * 0.45  # side by side where points would hide each other
        xs, ys = zip(*sorted(measured[name]))
        ax.plot([x + dx for x in xs], [100 * y for y in ys], ls="none", marker=MARKERS.get(name, "o"),
                ms=8, mfc=color, mec="black", mew=0.8, color=color,
                label=None if name in sim else f"{name} (executed)")
ax.set_xlabel("micro-batches per step, M (count)")
ax.set_ylabel("bubble: worst rank's idle / makespan (%)")
ax.set_xticks(range(8, 65, 8))
ax.set_xlim(6, 66)
ax.set_ylim(0, None)
ax.yaxis.set_major_formatter(PercentFormatter(decimals=0))
ax.grid(alpha=0.3)
ax.set_title("Pipeline bubble vs micro-batches at P = 8 ranks")
# per schedule: its line (simulator) and its marker (executed runs), in one entry
sched_handles = []  # a tuple draws the line and, on top of it, the opaque marker
for i, name in enumerate(names):
    color = SCHED_COLORS.get(name, f"C{i}")
    parts = []
    if name in sim:
        parts.append(Line2D([], [], color=color, **STYLE.get(name, dict(lw=2))))
    if name in measured:
        parts.append(Line2D([], [], ls="none", marker=MARKERS.get(name, "o"), ms=8, mfc=color,
                            mec="black", mew=0.8))
    sched_handles.append(tuple(parts))
leg = ax.legend(handles=sched_handles, labels=names, loc="upper right", title="schedule",
                handlelength=3.5)
ax.add_artist(leg)
ax.legend(handles=[Line2D([], [], color="black", lw=2, label="line: simulator"),
                   Line2D([], [], color="#bbbbbb", ls="none", marker="o", ms=8, mec="black",
                          label="marker: executed, 8 MPI ranks (--compute sleep)")],
          loc="upper center", title="how to read", )
# name the coinciding pairs on the curves themselves
for a, b, why, dy in [("gpipe", "1f1b", "same bubble", 14),
                      ("zb-h1", "dualpipev", "same ratio at these costs", 12)]:
    at = dict(sim.get(a, [])), dict(sim.get(b, []))
    if 44 in at[0] and 44 in at[1] and abs(at[0][44] - at[1][44]) < 1e-3:
        ax.annotate(f"{a} = {b} ({why})", (44, 100 * at[0][44]),
                    xytext=(0, dy), textcoords="offset points", ha="left", fontsize=10.5, color="#444")
fig.tight_layout()
fig.savefig(f"{out}/07_bubble.png")
plt.close(fig)
