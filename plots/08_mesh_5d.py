"""Lesson 08's part-2 figures: the 5D mesh (DP x PP x CP x TP, EP folded), from its --print-mesh,
--csv and --trace output (scripts/make-plots.sh runs it first).

usage: 08_mesh_5d.py MESH_TXT LOSS_CSV TRACE_JSON OUTDIR
  MESH_TXT    the output of 08_mesh --print-mesh on the mesh (make plots: 32 ranks, the default
              dp 4 x pp 2 x cp 2 x tp 2 with ep 2 folded): the header line ("world = dp 4 x pp 2
              x cp 2 x tp 2 = 32 ranks", the EP size from "EP(2)"), the "<axis> groups: [0 1]
              [2 3] ..." lines, and one line per rank with its index on every axis ("rank 5: ...
              tp 1, cp 0, dp 1, pp 0, ep 1, edp 2")
  LOSS_CSV    the --csv rows of two training runs from the same seed: one process (-np 1, the
              same --layers as the mesh's default) and the mesh, each run told apart by its world
              size dp x pp x cp x tp. Used: kind=step rows (loss_mesh every step; loss_ref, one
              process's loss from the mesh's own weights, on the checked steps, nan otherwise),
              and the mesh's kind=rank and kind=rank_formula rows (per rank, the payload bytes it
              moved in the last step on each axis, measured by the counters and by the lesson's
              formula: tp_bytes, cp_bytes, ep_bytes, dp_bytes (the dp x cp group), edp_bytes
              (expert data parallel), pp_bytes)
  TRACE_JSON  the mesh's Chrome trace (--trace) of a short run (--train 3): pid = rank, tid 1
              compute (a "step N" span per training step holding the pipeline's op spans F0(1),
              B0(1), I0(2), W0(0), "F0(3)&B1(1)"), tid 2 comm ("<axis> <op>" spans: "tp allgather",
              "ep all-to-all", "dp-cp reduce_scatter", "pp recv", ...); the check track is ignored
writes, into OUTDIR:
  08_mesh_5d_mesh.png   the ranks laid out once (the pp stages as two blocks, in each a row per
                        dp index and a column per (cp, tp) index), then the same layout once per
                        axis (tp, cp, dp, pp, dp x cp, ep, edp) with the cells of each group of
                        that axis in one colour; a panel whose groups equal another axis's says so
                        (here ep's are tp's: EP 2 is folded onto consecutive ranks, tp fastest,
                        and edp's are dp x cp's); a text panel says what ep, edp and dp x cp are
  08_mesh_5d_loss.png   above, the loss per step of one process and of the mesh, trained apart
                        from the same seed, overlaid; below, on a log scale, |mesh - one process|
                        per step, the lesson's check on the checked steps (the mesh's loss against
                        one process's from the mesh's own weights) and one float32 rounding of
                        the loss, eps |loss|; the title counts the steps within that rounding
  08_mesh_5d_comm.png   a panel per axis: the KiB each rank moved on that axis in one step (bars,
                        ranks on x) with the lesson's formula for the rank marked on each bar (a
                        black tick); the panel title counts the ranks where the two are equal
  08_mesh_5d_gantt.png  a Gantt chart of one training step (step 1, or the first after step 0)
                        of the trace: a row per rank, rank 0 on top; in the upper half of each row
                        the pipeline's compute ops coloured by kind (forward, backward or its
                        input-gradient half, weight gradient), in the lower half the
                        communication spans coloured by axis; a light grey band is the rank's
                        "step N" span; time in ms from the earliest start of the step on any rank.
                        The ranks start each step together (the lesson waits at a barrier of
                        its check's own before every step), so stage 1 visibly waits in its
                        first pp recv for stage 0's first forward: the pipeline's bubble
If a run appears twice in LOSS_CSV (the same world size, its steps starting again), the last
one counts."""
import csv
import json
import math
import re
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

if len(sys.argv) != 5:
    sys.exit(__doc__)
mesh_txt, loss_csv, trace_json, out = sys.argv[1:]
plt.rcParams.update({"font.size": 15, "axes.titlesize": 17, "axes.labelsize": 15,
                     "legend.fontsize": 13, "xtick.labelsize": 13, "ytick.labelsize": 13})
FIG = dict(figsize=(12.8, 7.2), dpi=100)
EPS32 = 2.0 ** -23  # float32 machine epsilon
KIB = 1024.0
# one colour per mesh axis, the same in every figure (the comm panels, the Gantt's comm spans)
AXES = ["tp", "cp", "ep", "dp-cp", "edp", "pp"]
AXIS_COLOR = {"tp": "#8172b3", "cp": "#dd8452", "ep": "#c44e52", "dp-cp": "#937860",
              "edp": "#da8bc3", "pp": "#ccb022", "other": "#9a9a9a"}
AXIS_TEXT = {"tp": "tp", "cp": "cp", "ep": "ep", "dp-cp": "dp \u00d7 cp", "edp": "edp (expert dp)",
             "pp": "pp", "other": "other"}
AXIS_CSV = {"tp": "tp_bytes", "cp": "cp_bytes", "ep": "ep_bytes", "dp-cp": "dp_bytes",
            "edp": "edp_bytes", "pp": "pp_bytes"}


def number(s):
    """A CSV cell as a float; empty and 'nan' cells as NaN."""
    try:
        return float(s)
    except (TypeError, ValueError):
        return math.nan


# ---------------------------------------------------------------- the mesh, from --print-mesh
HEADER_RE = re.compile(r"world = (.*?) = (\d+) ranks")
GROUPS_RE = re.compile(r"^\s*([a-z-]+) groups:\s*(.*)$")
RANK_RE = re.compile(r"^\s*rank (\d+):.*?\s((?:[a-z]+ \d+,?\s*)+)$")
header, groups, coords = None, {}, {}
for line in open(mesh_txt):
    line = line.rstrip("\n")
    if header is None and HEADER_RE.search(line):
        header = line
    elif GROUPS_RE.match(line):
        m = GROUPS_RE.match(line)
        groups[m.group(1)] = [[int(r) for r in g.split()] for g in re.findall(r"\[([\d ]*)\]", m.group(2))]
    elif RANK_RE.match(line):
        m = RANK_RE.match(line)
        coords[int(m.group(1))] = {k: int(v) for k, v in re.findall(r"([a-z]+) (\d+)", m.group(2))}
if header is None or not groups or not coords:
    sys.exit(f"error: {mesh_txt} is not the output of 08_mesh --print-mesh")
world_text, world = HEADER_RE.search(header).group(1), int(HEADER_RE.search(header).group(2))
size = {k: int(v) for k, v in re.findall(r"([a-z]+) (\d+)", world_text)}  # dp, pp, cp, tp
ep_match = re.search(r"EP\((\d+)\)", header)
size["ep"] = int(ep_match.group(1)) if ep_match else 1
MESH_TITLE = f"{world_text} = {world} ranks" + (f", ep {size['ep']} folded" if size["ep"] > 1 else "")
if sorted(coords) != list(range(world)):
    sys.exit(f"error: {mesh_txt} lists ranks {sorted(coords)[:4]}..., not 0..{world - 1}")
for k in ("dp", "pp", "cp", "tp"):
    size.setdefault(k, 1)

# ---------------------------------------------------------------- 1. the mesh's groups
# a rank's cell: block pp (left to right), row dp (top down), column cp * tp_size + tp
NCOL = size["cp"] * size["tp"]
GAP = 0.6  # between the pp blocks, in cells


def cell_xy(r):
    c = coords[r]
    x = c.get("pp", 0) * (NCOL + GAP) + c.get("cp", 0) * size["tp"] + c.get("tp", 0)
    return x, c.get("dp", 0)


# distinct hues first (tab20's dark halves), then their light halves
TAB20 = plt.get_cmap("tab20").colors
PALETTE = [TAB20[i] for i in range(0, 20, 2)] + [TAB20[i] for i in range(1, 20, 2)]
PANEL_AXES = [a for a in ["tp", "cp", "dp", "pp", "dp-cp", "ep", "edp"] if a in groups]
PANEL_TEXT = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp-cp": "dp \u00d7 cp",
              "ep": "ep", "edp": "edp (expert dp)"}


def text_color(rgb):
    r, g, b = rgb[:3]
    return "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"


def draw_layout(ax, color_of, title, title_color="black", key=False):
    width = size["pp"] * NCOL + (size["pp"] - 1) * GAP
    for r in range(world):
        x, y = cell_xy(r)
        c = color_of(r)
        ax.add_patch(Rectangle((x + 0.04, y + 0.04), 0.92, 0.92, facecolor=c, edgecolor="white", lw=0.5))
        ax.text(x + 0.5, y + 0.5, str(r), ha="center", va="center", fontsize=12,
                color=text_color(c))
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(size["dp"] + 0.05, -0.05)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    for s in ax.spines.values():
        s.set_visible(False)
    ax.set_title(title, fontsize=13, color=title_color, pad=40 if key else 4)
    if key:  # name the block, row and column coordinates
        for p in range(size["pp"]):
            x0 = p * (NCOL + GAP)
            ax.text(x0 + NCOL / 2, -0.78, f"pp {p}", ha="center", va="bottom", fontsize=12, weight="bold")
            for j in range(NCOL):
                ax.text(x0 + j + 0.5, -0.04, f"cp {j // size['tp']}\ntp {j % size['tp']}",
                        ha="center", va="bottom", fontsize=9, linespacing=0.95)
        for d in range(size["dp"]):
            ax.text(-0.15, d + 0.5, f"dp {d}", ha="right", va="center", fontsize=11)


# a 3 x 3 grid by hand (tight_layout misplaces axes of equal aspect): the key, seven axes, notes
fig, axs = plt.subplots(3, 3, **FIG, gridspec_kw=dict(left=0.045, right=0.995, bottom=0.01, top=0.82,
                                                      wspace=0.06, hspace=0.42))
axs = axs.ravel()
key_colors = [PALETTE[0], PALETTE[1], PALETTE[2], PALETTE[3]]
draw_layout(axs[0], lambda r: tuple(0.55 + 0.45 * v for v in key_colors[coords[r].get("pp", 0) % 4]),
            "the layout: a row per dp, a column per (cp, tp)", key=True)
same_as = {}
for i, a in enumerate(PANEL_AXES):
    canon = sorted(tuple(g) for g in groups[a])
    twin = next((b for b in PANEL_AXES[:i] if sorted(tuple(g) for g in groups[b]) == canon), None)
    if twin:
        same_as[a] = twin
for ax, a in zip(axs[1:], PANEL_AXES):
    gs = groups[a]
    group_of = {r: i for i, g in enumerate(gs) for r in g}
    n = len(gs[0]) if gs else 0
    title = f"{PANEL_TEXT[a]}: {len(gs)} group{'s' * (len(gs) != 1)} of {n}"
    if a in same_as:
        title += f" (= {PANEL_TEXT[same_as[a]].split(' (')[0]}'s)"
    draw_layout(ax, lambda r: PALETTE[group_of[r] % len(PALETTE)], title)
notes = [ax for ax in axs[1 + len(PANEL_AXES):]]
for ax in notes:
    ax.axis("off")
if notes:
    order = re.search(r"\(order ([^)]*)\)", header)
    lines = [f"rank order: {order.group(1)}" if order else "",
             "ep: EP folded onto the dp \u00d7 cp \u00d7 tp",
             "  ranks, consecutive ranks (tp fastest)",
             "edp: the ranks holding the same",
             "  experts (their gradients' group)",
             "dp \u00d7 cp: the dense weights'",
             "  gradient group (ZeRO-1 shards)"]
    notes[0].text(0.0, 0.5, "\n".join(l for l in lines if l), ha="left", va="center", fontsize=12,
                  transform=notes[0].transAxes, linespacing=1.35)
fig.suptitle(f"Lesson 08: the 5D mesh, {MESH_TITLE}; one colour per group of each axis",
             fontsize=15)
fig.savefig(f"{out}/08_mesh_5d_mesh.png")
plt.close(fig)

# ---------------------------------------------------------------- the two runs of LOSS_CSV


def run_world(row):
    return math.prod(int(row[k] or 1) for k in ("dp", "tp", "cp", "pp"))


steps_of, rank_rows, formula_rows = {}, defaultdict(dict), defaultdict(dict)
for row in csv.DictReader(open(loss_csv)):
    w = run_world(row)
    if row["kind"] == "step":
        step = int(row["step"])
        if w not in steps_of or step <= int(steps_of[w][-1]["step"]):
            if w in steps_of and step != 0:
                sys.exit(f"error: {loss_csv}: the run on {w} ranks restarts at step {step}, not 0")
            steps_of[w] = []
        steps_of[w].append(row)
    elif row["kind"] == "rank":
        rank_rows[w][int(row["rank"])] = row
    elif row["kind"] == "rank_formula":
        formula_rows[w][int(row["rank"])] = row
if 1 not in steps_of:
    sys.exit(f"error: {loss_csv} has no one-process run")
if world not in steps_of:
    sys.exit(f"error: {loss_csv} has no run on {world} ranks (the mesh of {mesh_txt})")
ref_rows, mesh_rows = steps_of[1], steps_of[world]
C_REF, C_MESH = "#222222", "#dd8452"

# ---------------------------------------------------------------- 2. the loss
ref_loss = {int(r["step"]): number(r["loss_mesh"]) for r in ref_rows}
fig, (ax1, ax2) = plt.subplots(2, 1, **FIG, sharex=True, gridspec_kw=dict(height_ratios=(1, 1.5)))
steps = sorted(ref_loss)
ax1.plot(steps, [ref_loss[s] for s in steps], color=C_REF, lw=6, alpha=0.25, label="one process")
ax1.plot([int(r["step"]) for r in mesh_rows], [number(r["loss_mesh"]) for r in mesh_rows],
         color=C_MESH, lw=1.4, label=f"the mesh, {world} ranks")
ax1.set_ylabel("training loss")
ax1.set_title("the loss of each run, trained apart from the same seed, overlaid", fontsize=15)
ax1.legend(loc="upper right")

FLOOR = 1e-9  # an exact 0 is drawn here
xs, ys = [], []
for r in mesh_rows:
    s = int(r["step"])
    if s in ref_loss:
        xs.append(s)
        ys.append(max(abs(number(r["loss_mesh"]) - ref_loss[s]), FLOOR))
ax2.scatter(xs, ys, s=12, color=C_MESH, alpha=0.6, lw=0)
checked = [(int(r["step"]), abs(number(r["loss_mesh"]) - number(r["loss_ref"])))
           for r in mesh_rows if not math.isnan(number(r["loss_ref"]))]
ax2.scatter([s for s, _ in checked], [max(d, FLOOR) for _, d in checked], s=110, marker="D",
            facecolor=C_MESH, edgecolor="black", zorder=5)
rounding = [EPS32 * abs(ref_loss[s]) for s in steps]
ax2.plot(steps, rounding, color="black", lw=1.2, ls=":")
ax2.set_yscale("log")
high = max(ys + [d for _, d in checked] + rounding)
top_exp = math.ceil(math.log10(high)) + 2  # two decades above the data for the legend
ax2.set_ylim(FLOOR / 3, 10.0 ** top_exp)
ticks = [FLOOR] + [10.0 ** e for e in range(round(math.log10(FLOOR)) + 1, top_exp + 1)]
ax2.set_yticks(ticks)
ax2.set_yticklabels(["0 (equal)"] + [f"$10^{{{round(math.log10(t))}}}$" for t in ticks[1:]])
ax2.minorticks_off()
ax2.set_xlabel("training step")
ax2.set_ylabel("|loss difference|")
within = sum(abs(number(r["loss_mesh"]) - ref_loss[int(r["step"])]) <= EPS32 * abs(ref_loss[int(r["step"])])
             for r in mesh_rows if int(r["step"]) in ref_loss)
ax2.set_title(f"|mesh's loss \u2212 one process's| per step ({within} of {len(xs)} steps within "
              "\u03b5|loss|), and from the same weights (\u25c6)", fontsize=14, pad=8)
ax2.legend(handles=[Line2D([], [], ls="", marker="o", ms=5, color=C_MESH,
                           label="the mesh's run vs the one-process run, same step"),
                    Line2D([], [], ls="", marker="D", ms=9, mfc=C_MESH, mec="black",
                           label="the lesson's check: the mesh vs one process from the mesh's weights"),
                    Line2D([], [], color="black", lw=1.2, ls=":",
                           label="one float32 rounding of the loss, \u03b5|loss|")],
           loc="upper right", fontsize=12)
fig.suptitle(f"Lesson 08: one process and the 5D mesh train the same model\n{MESH_TITLE}",
             fontsize=16, y=0.995)
fig.tight_layout()
fig.savefig(f"{out}/08_mesh_5d_loss.png")
plt.close(fig)

# ---------------------------------------------------------------- 3. bytes per rank per axis
meas, form = rank_rows[world], formula_rows[world]
if sorted(meas) != list(range(world)) or sorted(form) != list(range(world)):
    sys.exit(f"error: {loss_csv}: the {world}-rank run lacks kind=rank or kind=rank_formula rows "
             "for some ranks")
ranks = list(range(world))
fig, axs = plt.subplots(3, 2, **FIG, sharex=True)
for ax, a in zip(axs.T.ravel(), AXES):  # down the left column, then the right
    col = AXIS_CSV[a]
    mv = [number(meas[r][col]) / KIB for r in ranks]
    fv = [number(form[r][col]) / KIB for r in ranks]
    ax.bar(ranks, mv, 0.8, color=AXIS_COLOR[a])
    ax.hlines(fv, [r - 0.45 for r in ranks], [r + 0.45 for r in ranks], color="black", lw=2.2)
    equal = sum(int(meas[r][col]) == int(form[r][col]) for r in ranks)
    top = max(mv + fv) or 1.0
    ax.set_ylim(0, top * 1.18)
    ax.set_title(f"{AXIS_TEXT[a]}: measured = formula on {equal} of {world} ranks",
                 fontsize=13, color="black" if equal == world else "#c00000", loc="left", pad=3)
    ax.set_ylabel("KiB", fontsize=12)
    ax.tick_params(labelsize=11)
    if size["pp"] > 1:  # the pp stages' boundaries
        per_stage = world // size["pp"]
        for p in range(1, size["pp"]):
            ax.axvline(p * per_stage - 0.5, color="#777777", lw=1, ls="--")
for ax in axs[-1]:
    ax.set_xticks(range(0, world, 2 if world <= 32 else 4))
    ax.set_xticks(ranks, minor=True)
    ax.set_xlabel("rank", fontsize=12)
    ax.set_xlim(-0.7, world - 0.3)
fig.legend(handles=[Patch(color="#bbbbbb",
                          label="bar: measured (Comm's counters, payload), in the axis's colour"),
                    Line2D([], [], color="black", lw=2.2, label="the lesson's formula for the rank")],
           loc="lower center", ncol=2, fontsize=12, frameon=False)
last = next(iter(meas.values()))["step"]
fig.suptitle(f"Lesson 08: the KiB each rank moves on each axis in one training step (step {last})\n"
             f"{MESH_TITLE}" + ("; dashed: where pp stage 0 ends" if size["pp"] > 1 else ""),
             fontsize=15)
fig.tight_layout(rect=(0, 0.04, 1, 1))
fig.savefig(f"{out}/08_mesh_5d_comm.png")
plt.close(fig)

# ---------------------------------------------------------------- 4. Gantt chart of one step
trace = json.load(open(trace_json))
events = trace["traceEvents"] if isinstance(trace, dict) else trace
step_span = defaultdict(dict)  # step -> rank -> (start, end) in us
for e in events:
    if e.get("ph") == "X" and e.get("tid") == 1 and re.fullmatch(r"step \d+", e.get("name", "")):
        step_span[int(e["name"].split()[1])][e["pid"]] = (e["ts"], e["ts"] + e["dur"])
later = sorted(s for s in step_span if s > 0)
if not later:
    sys.exit(f"error: {trace_json} has no 'step N' span after step 0; run with --train 3 --trace")
STEP = 1 if 1 in step_span else later[0]
spans_of = step_span[STEP]
t0 = min(s for s, _ in spans_of.values())
t1 = max(e for _, e in spans_of.values())
OP_RE = re.compile(r"^([FBIW])\d+\(\d+\)$")
KIND = {"F": ("forward (F)", "#1f77b4"), "B": ("backward (B), input grad. (I)", "#2ca02c"),
        "W": ("weight grad. (W)", "#17becf"), "F&B": ("pair F&B (dualpipev)", "#6a9fd0")}


def op_kind(name):
    parts = name.split("&")
    if not all(OP_RE.match(p) for p in parts):
        return None
    if len(parts) > 1:
        return "F&B"
    k = parts[0][0]
    return "B" if k == "I" else k


def comm_axis(name):
    first = name.split(" ", 1)[0]
    return first if first in AXIS_COLOR and first != "other" and " " in name else "other"


compute, comm = defaultdict(list), defaultdict(list)
for e in events:
    if e.get("ph") != "X" or e["pid"] not in spans_of:
        continue
    s, d = e["ts"], e.get("dur", 0)
    if s + d < t0 or s > t1:
        continue
    if e.get("tid") == 1:
        k = op_kind(e.get("name", ""))
        if k:
            compute[e["pid"]].append((s, d, k))
    elif e.get("tid") == 2:
        comm[e["pid"]].append((s, d, comm_axis(e.get("name", ""))))
MS = 1e-3
fig, ax = plt.subplots(**FIG)
busy = defaultdict(float)
for r, (s, e) in spans_of.items():
    y = r
    ax.add_patch(Rectangle(((s - t0) * MS, y - 0.46), (e - s) * MS, 0.92, facecolor="#ececec",
                           edgecolor="none", zorder=0))
    for cs, cd, k in compute[r]:
        ax.add_patch(Rectangle(((cs - t0) * MS, y - 0.44), cd * MS, 0.5, facecolor=KIND[k][1],
                               edgecolor="white", lw=0.4, zorder=2))
    for cs, cd, a in comm[r]:
        ax.add_patch(Rectangle(((cs - t0) * MS, y + 0.1), cd * MS, 0.32, facecolor=AXIS_COLOR[a],
                               edgecolor="none", zorder=3))
        busy[a] += cd
nr = len(spans_of)
ax.set_ylim(nr - 0.5, -0.5)
ax.set_xlim(0, (t1 - t0) * MS)
ax.set_yticks(range(nr))
ax.set_yticklabels([str(r) if r % 2 == 0 else "" for r in range(nr)], fontsize=10)
ax.set_yticks(range(nr), minor=True)
ax.set_ylabel("rank")
ax.set_xlabel(f"ms from the start of step {STEP} (earliest rank)")
if size["pp"] > 1:
    per_stage = world // size["pp"]
    for p in range(size["pp"]):
        if p:
            ax.axhline(p * per_stage - 0.5, color="black", lw=1.2)
        ax.text(1.005, (p + 0.5) * per_stage - 0.5, f"pp stage {p}", transform=ax.get_yaxis_transform(),
                rotation=90, ha="left", va="center", fontsize=13)
present_kinds = [k for k in KIND if any(k == kk for v in compute.values() for _, _, kk in v)]
present_axes = [a for a in AXES + ["other"] if busy.get(a)]
handles = [Patch(color=KIND[k][1], label=KIND[k][0]) for k in present_kinds]
handles += [Patch(color=AXIS_COLOR[a], label=f"{AXIS_TEXT[a]} comm") for a in present_axes]
handles.append(Patch(facecolor="#ececec", label=f"the rank's step {STEP}"))
ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.1), fontsize=11, frameon=False,
          ncol=math.ceil(len(handles) / (2 if len(handles) <= 10 else 3)), columnspacing=1.2)
ax.set_title(f"Lesson 08: training step {STEP} on {MESH_TITLE}\nper rank: the pipeline's compute ops "
             "(upper half), communication by axis (lower half);\nthe ranks start the step together: "
             "stage 1 waits for stage 0's first forward (the pipeline's bubble)",
             fontsize=14)
fig.tight_layout()
fig.savefig(f"{out}/08_mesh_5d_gantt.png")
plt.close(fig)
