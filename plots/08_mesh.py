"""Lesson 08's figures, from its --csv output (scripts/make-plots.sh runs it first).

usage: 08_mesh.py LOSS_CSV MEMORY_CSV OUTDIR
  LOSS_CSV    rows of several training runs of 08_mesh (--train 200, the same seed and batch):
              one on one process (-np 1 --tp 1) and several meshes; each run is told apart by
              its (dp, tp, zero, sp). Columns kind,dp,tp,zero,sp,step,loss_mesh,loss_ref,
              grad_err_ratio,tp_bytes,dp_bytes,mem_params,mem_grads,mem_optimizer,mem_buffers,
              formula_total; the kind=step rows are used: loss_mesh every step, loss_ref (one
              process's loss from the mesh's own weights) on the checked steps, tp_bytes and
              dp_bytes (payload bytes of rank 0's collectives on each axis in that step)
  MEMORY_CSV  the same columns from short runs with --tp 1 at several DP sizes, ZeRO-0 to
              ZeRO-3; the kind=memory rows are used: the bytes rank 0 held between steps for
              parameters, gradients, AdamW's m and v and the collectives' flat buffers, and seed
              001's fp32 formula (4N + 4N + 8N; ZeRO-1 8N/dp for m and v, ZeRO-2 also 4N/dp for
              the gradients, ZeRO-3 also 4N/dp for the parameters, each ceil'd per piece)
writes OUTDIR/08_mesh_loss.png (the loss curves of every run overlaid, and below, on a log
scale, each mesh's distance from the one-process run step by step, with the lesson's check:
the mesh's loss against one process's from the same weights), 08_mesh_memory.png (memory
per rank, measured and the formula, against DP for ZeRO-0 to ZeRO-3) and 08_mesh_comm.png
(payload bytes per step on the TP and the DP axis for each run of LOSS_CSV).
If a run appears twice in a CSV (the same key, its steps starting again), the last one counts."""
import csv
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

if len(sys.argv) != 4:
    sys.exit(__doc__)
loss_csv, memory_csv, out = sys.argv[1:]
plt.rcParams.update({"font.size": 15, "axes.titlesize": 17, "axes.labelsize": 15,
                     "legend.fontsize": 13, "xtick.labelsize": 13, "ytick.labelsize": 13})
FIG = dict(figsize=(12.8, 7.2), dpi=100)
EPS32 = 2.0 ** -23  # float32 machine epsilon
KIB = 1024.0


def number(s):
    """A CSV cell as a float; empty and 'nan' cells as NaN."""
    try:
        return float(s)
    except ValueError:
        return math.nan


def run_key(row):
    """(dp, tp, zero, sp) of a row: what tells the runs in one CSV apart."""
    return tuple(int(row[k]) for k in ("dp", "tp", "zero", "sp"))


def mesh_label(key, zero=False):
    """'1 process', 'DP 2', 'TP 2 + SP', 'DP 2 x TP 2 + SP'; with zero, the ZeRO stage after."""
    dp, tp, z, sp = key
    axes = [f"DP {dp}"] * (dp > 1) + [f"TP {tp}"] * (tp > 1)
    text = " \u00d7 ".join(axes) if axes else "1 process"
    if sp:
        text += " + SP"
    if zero and dp > 1:
        text += f", ZeRO-{z}"
    return text


def load_steps(path):
    """{key: [step rows in step order]}, the last run of each key."""
    runs = {}
    for row in csv.DictReader(open(path)):
        if row["kind"] != "step":
            continue
        key, step = run_key(row), int(row["step"])
        if key not in runs or step <= int(runs[key][-1]["step"]):
            if key in runs and step != 0:
                sys.exit(f"error: {path}: run {key} restarts at step {step}, not 0")
            runs[key] = []
        runs[key].append(row)
    return runs


def load_memory(path):
    """{key: memory row}, the last of each key."""
    return {run_key(r): r for r in csv.DictReader(open(path)) if r["kind"] == "memory"}


runs = load_steps(loss_csv)
single = [k for k in runs if k[0] == 1 and k[1] == 1]
if not single:
    sys.exit(f"error: {loss_csv} has no one-process run (dp 1, tp 1)")
REF = single[0]
# the meshes by world size, then DP before TP
meshes = sorted((k for k in runs if k != REF), key=lambda k: (k[0] * k[1], k[1], k))
COLORS = ["#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#4c72b0"]
color = {k: COLORS[i % len(COLORS)] for i, k in enumerate(meshes)}
color[REF] = "#222222"
DASHES = [(None, None), (6, 3), (2, 2), (8, 3, 2, 3)]
dashes = {k: DASHES[i % len(DASHES)] for i, k in enumerate(meshes)}

# ---- 1. the loss curves, and each mesh's distance from the one-process run
ref_loss = {int(r["step"]): number(r["loss_mesh"]) for r in runs[REF]}
fig, (ax1, ax2) = plt.subplots(2, 1, **FIG, sharex=True, gridspec_kw=dict(height_ratios=(1, 1.7)))
steps = sorted(ref_loss)
ax1.plot(steps, [ref_loss[s] for s in steps], color=color[REF], lw=6, alpha=0.25,
         label=mesh_label(REF, zero=True))
for k in meshes:
    rows = runs[k]
    line, = ax1.plot([int(r["step"]) for r in rows], [number(r["loss_mesh"]) for r in rows],
                     color=color[k], lw=1.4, label=mesh_label(k, zero=True))
    if dashes[k][0] is not None:
        line.set_dashes(dashes[k])
ax1.set_ylabel("training loss")
ax1.set_title("the loss of every run, one process (wide grey) and the meshes, overlaid")
ax1.legend(ncol=3, loc="upper right")

# below: |loss_mesh - loss of the one-process run| at the same step (dots), its largest value so
# far (a line); an exact 0 is drawn at FLOOR
FLOOR = 1e-9
first_apart = {}
for k in meshes:
    xs, ys = [], []
    for r in runs[k]:
        s = int(r["step"])
        if s in ref_loss:
            d = abs(number(r["loss_mesh"]) - ref_loss[s])
            xs.append(s)
            ys.append(max(d, FLOOR))
            if d > 100 * EPS32 * abs(ref_loss[s]) and k not in first_apart:
                first_apart[k] = (s, d)  # the first step beyond 100 roundings of the loss
    ax2.scatter(xs, ys, s=9, color=color[k], alpha=0.45, lw=0)
    high, run_max = FLOOR, []
    for y in ys:
        high = max(high, y)
        run_max.append(high)
    line, = ax2.step(xs, run_max, where="post", color=color[k], lw=2.2)
    if dashes[k][0] is not None:
        line.set_dashes(dashes[k])
# the lesson's check: the mesh's loss against one process's from the mesh's own weights, the
# meshes' markers side by side around each checked step
spread = 2.0
for n, k in enumerate(meshes):
    pts = [(int(r["step"]), abs(number(r["loss_mesh"]) - number(r["loss_ref"])))
           for r in runs[k] if not math.isnan(number(r["loss_ref"]))]
    shift = (n - (len(meshes) - 1) / 2) * spread
    ax2.scatter([s + shift for s, _ in pts], [max(d, FLOOR) for _, d in pts], s=90, marker="D",
                facecolor=color[k], edgecolor="black", zorder=5)
ax2.plot(steps, [EPS32 * abs(ref_loss[s]) for s in steps], color="black", lw=1.2, ls=":")
ax2.set_yscale("log")
ax2.set_ylim(FLOOR / 3, 1e3)
ticks = [FLOOR, 1e-7, 1e-5, 1e-3, 1e-1]
ax2.set_yticks(ticks)
ax2.set_yticklabels(["0 (equal)"] + [f"$10^{{{round(math.log10(t))}}}$" for t in ticks[1:]])
ax2.set_xlabel("training step")
ax2.set_ylabel("|loss difference|")
ax2.set_title("|mesh's loss \u2212 one process's|: the two runs, step by step (dots; line: largest "
              "so far), and from the same weights (\u25c6)", fontsize=14)
if first_apart:
    s0, d0 = min(first_apart.values())
    parted = [mesh_label(k) for k in meshes if first_apart.get(k, (None,))[0] == s0]
    ax2.annotate(f"step {s0}: {' and '.join(parted)}\nleave{'s' if len(parted) == 1 else ''} "
                 "the one-process run: a rounding-sized\n"
                 "weight difference flips a near-tie of the MoE's\ntop-k routing "
                 "(discontinuous), the runs part;\neach step still equals one process's from the\n"
                 "same weights (\u25c6)",
                 xy=(s0, d0), xytext=(0.008, 0.97), textcoords="axes fraction", ha="left", va="top",
                 fontsize=12, bbox=dict(facecolor="white", alpha=0.92, edgecolor="#999999"),
                 arrowprops=dict(arrowstyle="->", color="#555555"))
ax2.legend(handles=[Line2D([], [], color="#555555", lw=2.2,
                           label="mesh run vs the one-process run, largest so far"),
                    Line2D([], [], ls="", marker="D", ms=9, mfc="#bbbbbb", mec="black",
                           label="mesh vs one process from the same weights (the check)"),
                    Line2D([], [], color="black", lw=1.2, ls=":",
                           label="one float32 rounding of the loss, \u03b5|loss|")],
           loc="upper right", fontsize=12)
fig.suptitle("Lesson 08: one process and the DP \u00d7 TP meshes train the same model", y=0.995)
fig.tight_layout()
fig.savefig(f"{out}/08_mesh_loss.png")
plt.close(fig)

# ---- 2. memory per rank against DP, ZeRO-0 to ZeRO-3, measured and the formula
mem = load_memory(memory_csv)
if not mem:
    sys.exit(f"error: {memory_csv} has no kind=memory rows")
PART = [("mem_params", "parameters (4N; ZeRO-3: 4N/dp)", "#4c72b0"),
        ("mem_grads", "gradients (4N; ZeRO-2, -3: 4N/dp)", "#55a868"),
        ("mem_optimizer", "AdamW m, v (8N; ZeRO-1, -2, -3: 8N/dp)", "#dd8452")]
BUF = ("mem_buffers", "the collectives' flat buffers,\nnot in the formula", "#bbbbbb")
STAGE = {0: "everything on every rank", 1: "m, v split over DP", 2: "+ gradients split",
         3: "+ parameters split"}
zeros = sorted({k[2] for k in mem})
fig, ax = plt.subplots(**FIG)
xs, labels, x = [], [], 0.0
top = max(sum(number(r[c]) for c, _, _ in PART + [BUF]) for r in mem.values()) / KIB
for z in zeros:
    keys = sorted((k for k in mem if k[2] == z), key=lambda k: (k[1], k[0], k[3]))
    start = x
    for k in keys:
        r = mem[k]
        bottom = 0.0
        for col, _, c in PART:
            v = number(r[col]) / KIB
            ax.bar(x, v, 0.7, bottom=bottom, color=c, edgecolor="white")
            if col == "mem_optimizer":
                ax.text(x, bottom + v / 2, f"{v:.0f}", ha="center", va="center", fontsize=12,
                        color="black")
            bottom += v
        v = number(r[BUF[0]]) / KIB
        ax.bar(x, v, 0.7, bottom=bottom, facecolor="white", edgecolor=BUF[2], hatch="//", lw=1)
        formula = number(r["formula_total"]) / KIB
        ax.plot([x - 0.45, x + 0.45], [formula, formula], color="black", lw=3)
        ax.text(x, bottom + v + top * 0.01, f"{(bottom + v) / KIB:.2f}\nMiB", ha="center", va="bottom",
                fontsize=11)
        xs.append(x)
        dp, tp = k[0], k[1]
        labels.append(f"DP {dp}" + (f" \u00d7 TP {tp}" if tp > 1 else ""))
        x += 1
    ax.text((start + x - 1) / 2, -0.11, f"ZeRO-{z}\n({STAGE.get(z, '')})",
            ha="center", va="top", fontsize=14, weight="bold", transform=ax.get_xaxis_transform())
    x += 0.8
ax.set_xticks(xs)
ax.set_xticklabels(labels)
ax.set_ylim(0, top * 1.42)
ax.set_ylabel("KiB allocated by rank 0 (float32)")
n_params = {round(number(r["mem_params"]) / 4) for k, r in mem.items() if k[2] < 3}  # ZeRO-3's are shards
ax.set_title(f"Lesson 08: rank 0's memory by ZeRO stage and DP (TP 1, N = "
             f"{', '.join(map(str, sorted(n_params)))}), measured vs formula")
handles = [Patch(color=c, label=l) for _, l, c in PART]
handles.append(Patch(facecolor="white", edgecolor=BUF[2], hatch="//", label=BUF[1]))
handles.append(Line2D([], [], color="black", lw=3, label="seed 001's formula: params + grads + AdamW"))
ax.legend(handles=handles, loc="upper left", ncol=2, fontsize=12)
fig.tight_layout()
fig.savefig(f"{out}/08_mesh_memory.png")
plt.close(fig)

# ---- 3. payload bytes per step on each axis, for the runs of figure 1
order = [REF] + meshes
per_step = {}
for k in order:
    tp_b = sorted({int(r["tp_bytes"]) for r in runs[k]})
    dp_b = sorted({int(r["dp_bytes"]) for r in runs[k]})
    if len(tp_b) > 1 or len(dp_b) > 1:
        print(f"08_mesh.py: {mesh_label(k, True)}: bytes vary over the steps; the largest drawn",
              file=sys.stderr)
    per_step[k] = (tp_b[-1], dp_b[-1])
fig, ax = plt.subplots(**FIG)
AXIS = [("TP", 0, 1, "#8172b3"), ("DP", 1, 0, "#c44e52")]
width = 0.38
top = max(max(v) for v in per_step.values()) / KIB
for j, (_, i, size_index, c) in enumerate(AXIS):
    for n, k in enumerate(order):
        v = per_step[k][i] / KIB
        xb = n + (j - 0.5) * width
        lone = k[size_index] == 1  # an axis of one rank: collectives counted there move nothing
        ax.bar(xb, v, width * 0.95, facecolor="white" if lone else c, edgecolor=c,
               hatch="xx" if lone else None, lw=1.5)
        ax.text(xb, v + top * 0.01, "none" if v == 0 else f"{v:.0f}", ha="center", va="bottom",
                fontsize=12)
ax.set_xticks(range(len(order)))
ax.set_xticklabels([mesh_label(k, zero=True).replace(", ", "\n") for k in order])
ax.set_ylim(0, top * 1.3)
ax.set_ylabel("KiB per training step (rank 0, payload)")
ax.set_title("Lesson 08: communication of one training step per mesh axis (rank 0's collectives)\n"
             "TP's follows the tokens of the TP group (B T / dp), DP's the parameters of the rank (N)",
             fontsize=16)
handles = [Patch(color=AXIS[0][3], label="TP axis: activations, the head's (m, l) merge, SP's replicated "
                                          "weights' gradients"),
           Patch(color=AXIS[1][3], label="DP axis: the gradients (ZeRO-0 all-reduce, ZeRO-1 "
                                          "reduce-scatter + all-gather), the MoE loads")]
if any(per_step[k][i] and k[size_index] == 1 for k in order for _, i, size_index, _ in AXIS):
    handles.append(Patch(facecolor="white", edgecolor="#777777", hatch="xx",
                         label="axis of 1 rank: collectives counted, nothing leaves the rank"))
ax.legend(handles=handles, loc="upper left", fontsize=12)
fig.tight_layout()
fig.savefig(f"{out}/08_mesh_comm.png")
plt.close(fig)
