"""Lesson 10's figures, from the lesson's --csv (scripts/make-plots.sh runs it first).

usage: 10_precision.py CSV OUTDIR
  CSV  the lesson's one csv (header kind,k,...,lr), appended to by every run make-plots.sh makes:
       kind=fp8 rows k,m,n,promote,acc_bits,recipe,recipe_ratio,never,fp32_acc,fine,per_tensor,
       one per K of the FP8 sweep, from three --part formats runs with --acc-bits 14 (the H800's,
       the lesson's default), 13 and 15, the same --k-max (a later row of the same K and width
       wins); kind=train rows precision,zero,grad_reduce,no_master,dp,step,loss,loss_ref,
       bf16_moved,dp_bytes,lr,moments, one per training step, from six 2-rank --part train runs:
       --precision fp32, bf16, bf16 --grad-reduce bf16, fp8 (lr 3e-3), and at --lr 1e-4 bf16 with and
       without (--bug no-master) float32 master weights (a later row of the same run and step wins)
Writes OUTDIR/10_fp8_error.png (the kind=fp8 rows) and OUTDIR/10_training.png (kind=train).

10_fp8_error.png. Left: the FP8 e4m3 GEMM's relative error against float64 of its
own dequantized operands, against K (log-log): DeepSeek-V3's recipe (1 x 128 and 128 x 128
tiles, the partial sum promoted every 128 products), the same GEMM never promoted (one scale
along K, all K products in the narrow accumulator), the recipe with a float32 accumulator; the
shading spans an accumulator of 13 to 15 bits, the lines are 14. The star is the report's claim
(section 3.3.2): nearly 2% at K = 4096 without promotion. Right: activations with outlier
channels (every 256th, x the lesson's --outlier, 10^4 by default), per-tile scales against one
scale per tensor, against float64 of the float32 inputs (so e4m3's rounding of the inputs is in
both).

10_training.png. Left: the training loss against the step (a 25-step trailing mean, each step
faint) of lesson 08's model on 2 data-parallel ranks, ZeRO-1: float32, bf16 matmul weights with
float32 masters, the same with the gradients summed in bf16, and the linear layers' GEMMs in FP8
(DeepSeek-V3's recipe, float32 weights); the last step's loss and the
mean of the last 50 in a box. Right: at lr 1e-4, bf16 with float32 masters against the planted
bug no-master (AdamW's update applied to the bf16 weights themselves): the loss, and on a twin
axis the share of bf16 weights a step changed (bf16_moved): without masters an update under half
a bf16 step rounds away, fewer weights move and the loss stalls."""
import csv
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

if len(sys.argv) != 3:
    sys.exit(__doc__.strip().splitlines()[2])
src, out = sys.argv[1:]
dst = f"{out}/10_fp8_error.png"

NEED = ("k", "m", "n", "promote", "acc_bits", "recipe", "never", "fp32_acc", "fine", "per_tensor")
NEED_TRAIN = ("precision", "zero", "grad_reduce", "no_master", "dp", "step", "loss", "bf16_moved", "dp_bytes", "lr",
              "moments")
BITS = (13, 14, 15)  # the accumulator widths make-plots.sh runs; 14 is the lines, 13..15 the bands
with open(src) as f:
    reader = csv.DictReader(f)
    missing = [c for c in ("kind",) + NEED + NEED_TRAIN if c not in (reader.fieldnames or [])]
    if missing:
        sys.exit(f"error: {src} has no column(s) {', '.join(missing)}: run 10_precision with --csv")
    rows = list(reader)
runs = {}  # acc_bits -> K -> row (kind=fp8)
for r in rows:
    if r["kind"] == "fp8":
        runs.setdefault(int(r["acc_bits"]), {})[int(r["k"])] = r
for bits in (14, 13, 15):
    if len(runs.get(bits, {})) < 2:
        sys.exit(f"error: {src} has {len(runs.get(bits, {}))} kind=fp8 rows with acc_bits={bits}, at least 2 needed "
                 f"(make-plots.sh runs 10_precision --part formats --k-max 16384 --acc-bits 13, 14 and 15 with --csv)")
ks = sorted(runs[14])
for bits in BITS:
    if sorted(runs[bits]) != ks:
        sys.exit(f"error: {src}: the acc_bits={bits} rows have K = {sorted(runs[bits])}, the acc_bits=14 rows "
                 f"{ks}: run all three with the same --k-max")

# kind=train: the six runs make-plots.sh makes, told apart by their flags (a run's steps in order)
TRAIN_RUNS = (  # key, precision, grad_reduce, no_master, lr, the run's flags
    ("fp32", "fp32", "fp32", 0, 3e-3, "--precision fp32"),
    ("bf16", "bf16", "fp32", 0, 3e-3, "--precision bf16"),
    ("bf16 sums", "bf16", "bf16", 0, 3e-3, "--precision bf16 --grad-reduce bf16"),
    ("fp8", "fp8", "fp32", 0, 3e-3, "--precision fp8"),
    ("masters", "bf16", "fp32", 0, 1e-4, "--precision bf16 --lr 1e-4"),
    ("no-master", "bf16", "fp32", 1, 1e-4, "--precision bf16 --lr 1e-4 --bug no-master"),
)
train = {}  # key -> step -> row
for r in rows:
    if r["kind"] != "train" or r["moments"] != "fp32":  # (make-plots.sh's runs keep float32 moments)
        continue
    for key, prec, reduce, no_master, lr, _ in TRAIN_RUNS:
        if (r["precision"], r["grad_reduce"], int(r["no_master"])) == (prec, reduce, no_master) and \
                math.isclose(float(r["lr"]), lr, rel_tol=1e-6):
            train.setdefault(key, {})[int(r["step"])] = r
for key, _, _, _, _, flags in TRAIN_RUNS:
    n = len(train.get(key, {}))
    if n < 2:
        sys.exit(f"error: {src} has {n} kind=train rows of the run '{flags}', at least 2 steps needed "
                 f"(make-plots.sh runs it: 10_precision on 2 ranks, --part train --train 500 {flags} --csv)")
    steps = sorted(train[key])
    if steps != list(range(len(steps))):
        sys.exit(f"error: {src}: the run '{flags}' has steps {steps[0]} .. {steps[-1]} with gaps ({n} rows): "
                 f"run it once with --csv into a fresh file")
tsteps = {key: sorted(train[key]) for key in train}
if len({len(v) for v in tsteps.values()}) != 1:
    sys.exit(f"error: {src}: the training runs have different lengths "
             f"({', '.join(f'{k}: {len(v)}' for k, v in tsteps.items())} steps): run them with the same --train")

first = runs[14][ks[0]]
promote, m, n = int(first["promote"]), int(first["m"]), int(first["n"])


def col(bits, name):
    return [float(runs[bits][k][name]) for k in ks]


plt.rcParams.update({"font.size": 14, "axes.titlesize": 15, "legend.fontsize": 12.5})
fig, (left, right) = plt.subplots(1, 2, figsize=(12.8, 7.2), dpi=100, gridspec_kw={"width_ratios": [1.55, 1]})

# ---- left: the three GEMMs against K, the accumulator's width as a band
RED, BLUE, GREEN = "#c44e52", "#4c72b0", "#55a868"
for name, color, marker, label in (
        ("never", RED, "s", "never promoted (14-bit accumulator)"),
        ("recipe", BLUE, "o", f"tiles, promoted every {promote} (DeepSeek-V3's recipe)")):
    left.fill_between(ks, col(15, name), col(13, name), color=color, alpha=0.15, lw=0)
    for bits, style in ((13, "--"), (15, ":")):
        left.loglog(ks, col(bits, name), style, color=color, lw=1.2, alpha=0.8)
        left.annotate(f"{bits} bits", (ks[-1], col(bits, name)[-1]), xytext=(6, 0), textcoords="offset points",
                      va="center", fontsize=11.5, color=color)
    left.loglog(ks, col(14, name), marker + "-", color=color, lw=2.4, ms=7, label=label)
left.loglog(ks, col(14, "fp32_acc"), "^-", color=GREEN, lw=2.4, ms=7, label="promoted, float32 accumulator")
left.fill_between([], [], [], color="gray", alpha=0.25, label="shaded: accumulator of 13 (dashed) to 15 bits (dotted)")
# the report's claim: K = 4096, never promoted, "a maximum relative error of nearly 2%"
left.plot([4096], [0.02], "*", color="black", ms=20, zorder=5)
left.annotate("DeepSeek-V3 report §3.3.2: nearly 2%\nat K = 4096 without promotion\n(its maximum relative error;\n"
              "here the norm-wise one)", (4096, 0.02), xytext=(ks[0], 0.12), textcoords="data", fontsize=12,
              va="center", arrowprops=dict(arrowstyle="->", color="black", lw=1.2, shrinkB=9))
left.set_xscale("log", base=2)
left.xaxis.set_major_locator(FixedLocator(ks))
left.xaxis.set_minor_locator(NullLocator())
left.set_xticklabels([str(k) for k in ks])
left.set_xlim(ks[0] / 1.3, ks[-1] * 2.2)
left.set_ylim(1e-8, 1.0)
left.set_xlabel("K (products summed per output element)")
left.set_ylabel("relative error ‖C − C₆₄‖ / ‖C₆₄‖  (log)")
left.set_title(f"FP8 e4m3 GEMM, {m} × K times K × {n},\nagainst float64 of its dequantized operands")
left.grid(alpha=0.3, which="major")
left.legend(loc="lower left", bbox_to_anchor=(0.0, 0.165), framealpha=0.95)

# ---- right: outlier channels, per-tile scales against one scale per tensor (the 14-bit run)
right.plot(ks, [100 * v for v in col(14, "fine")], "o-", color=BLUE, lw=2.4, ms=7,
           label="per-tile scales (1 × 128, 128 × 128)")
right.plot(ks, [100 * v for v in col(14, "per_tensor")], "D-", color="#dd8452", lw=2.4, ms=7,
           label="one scale per tensor")
right.set_xscale("log", base=2)
right.xaxis.set_major_locator(FixedLocator(ks[::2]))
right.xaxis.set_minor_locator(NullLocator())
right.set_xticklabels([str(k) for k in ks[::2]])
top = max(100 * max(col(14, "per_tensor")), 100 * max(col(14, "fine")))
right.set_ylim(0, top * 1.35)
right.set_xlabel("K")
right.set_ylabel("relative error (%)")
right.set_title("outlier channels: every 256th ×10⁴\n(--outlier), against the float32 inputs")
right.grid(alpha=0.3)
right.legend(loc="upper left")
right.text(0.5, 0.1, "both include e4m3's rounding\nof the inputs themselves", transform=right.transAxes, ha="center",
           fontsize=12.5, color="dimgray")

fig.suptitle(f"Lesson 10: DeepSeek-V3's FP8 GEMM: promote the narrow accumulator every {promote} products, "
             f"scale per tile", fontsize=16)
fig.tight_layout()
fig.savefig(dst)
plt.close(fig)
print(f"wrote {dst}")


# ---- 10_training.png: mixed-precision data-parallel training (kind=train rows)
dst = f"{out}/10_training.png"
SMOOTH = 25  # steps of the trailing mean: one step's loss (8 x 32 characters) is noisy


def tcol(key, name):
    return [float(train[key][s][name]) for s in tsteps[key]]


def smooth(v, w=SMOOTH):
    return [sum(v[max(0, i - w + 1):i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(v))]


def lr_text(x):  # 3e-3, 1e-4
    mant, exp = f"{x:.0e}".split("e")
    return f"{mant}e{int(exp)}"


def kib(key):
    return float(train[key][tsteps[key][-1]]["dp_bytes"]) / 1024


last = tsteps["fp32"][-1]
dp = int(train["fp32"][last]["dp"])
zero = int(train["fp32"][last]["zero"])
plt.rcParams.update({"font.size": 14, "axes.titlesize": 15, "legend.fontsize": 12.5})
fig, (left, right) = plt.subplots(1, 2, figsize=(12.8, 7.2), dpi=100)
ORANGE = "#dd8452"
# both panels' loss axis: from under the lowest 25-step mean to above the first step's loss
lo = min(min(smooth(tcol(k, "loss"))) for k in train) - 0.3
hi = max(max(tcol(k, "loss")[:SMOOTH]) for k in train) + 0.12

# left: float32 against bf16 with float32 masters, and bf16 gradient sums, lr 3e-3
for key, color, style, label in (
        ("fp32", "0.45", "-", "float32 throughout"),
        ("bf16", BLUE, "-", "bf16 weights + grads, float32 masters"),
        ("bf16 sums", ORANGE, "--", f"the same, gradients summed in bf16\n"
                                    f"({kib('bf16 sums'):.0f} KiB a step, not {kib('bf16'):.0f})"),
        ("fp8", GREEN, ":", "FP8 GEMMs in the linear layers\n(DeepSeek-V3's recipe, float32 weights)")):
    loss = tcol(key, "loss")
    left.plot(tsteps[key], loss, color=color, lw=0.6, alpha=0.18)
    left.plot(tsteps[key], smooth(loss), style, color=color, lw=6 if key == "fp32" else 2.4, label=label)
lr_fast = float(train["fp32"][last]["lr"])
left.set_ylim(lo, hi)
left.set_xlim(0, last)
left.set_xlabel("step")
left.set_ylabel("training loss (nats per character)")
left.set_title(f"lr {lr_text(lr_fast)}: bf16 and FP8 train as float32 does\n({SMOOTH}-step mean; faint: each step)")
left.grid(alpha=0.3)
left.legend(loc="upper right", framealpha=0.95)
box = [f"step {last}: the loss (mean of the last 50)"]
for key, name in (("fp32", "float32"), ("bf16", "bf16"), ("bf16 sums", "bf16 sums"), ("fp8", "fp8")):
    loss = tcol(key, "loss")
    box.append(f"{name:<10} {loss[-1]:.3f}  ({sum(loss[-50:]) / len(loss[-50:]):.3f})")
left.text(0.97, 0.55, "\n".join(box), transform=left.transAxes, ha="right", va="center", multialignment="left",
          family="monospace", fontsize=12.5, bbox=dict(boxstyle="round", facecolor="white", edgecolor="0.7"))

# right: lr 1e-4, float32 masters against none: the loss, and the share of bf16 weights a step moved
moved_ax = right.twinx()
for key, color, label in (("masters", BLUE, "float32 masters"), ("no-master", RED, "no master (--bug no-master)")):
    loss = tcol(key, "loss")
    right.plot(tsteps[key], loss, color=color, lw=0.6, alpha=0.18)
    right.plot(tsteps[key], smooth(loss), color=color, lw=2.4, label=f"loss, {label}")
    moved = [100 * v for v in tcol(key, "bf16_moved")]
    moved_ax.plot(tsteps[key], smooth(moved), ":", color=color, lw=2.2, label=f"bf16 weights moved, {label}")
    # the last step's values, right of the lines' ends
    right.annotate(f"{loss[-1]:.2f}", (tsteps[key][-1], smooth(loss)[-1]), xytext=(6, 0), textcoords="offset points",
                   va="center", color=color, fontsize=14, fontweight="bold")
    moved_ax.annotate(f"{moved[-1]:.1f}%", (tsteps[key][-1], smooth(moved)[-1]), xytext=(6, 0),
                      textcoords="offset points", va="center", color=color, fontsize=13)
lr_slow = float(train["masters"][last]["lr"])
right.set_ylim(lo, hi)
right.set_xlim(0, last * 1.17)
right.set_xticks(range(0, last + 1, 100))
moved_ax.set_ylim(0, 1.65 * max(max(smooth([100 * v for v in tcol(k, "bf16_moved")]))
                                 for k in ("masters", "no-master")))
right.set_xlabel(f"step (right of the lines: step {last}'s values)")
right.set_ylabel("training loss (solid)")
moved_ax.set_ylabel("bf16 weights a step changed, % (dotted)")
right.set_title(f"lr {lr_text(lr_slow)}: without masters, updates under half\n"
                "a bf16 step round away and the model stalls")
right.grid(alpha=0.3)
h1, l1 = right.get_legend_handles_labels()
h2, l2 = moved_ax.get_legend_handles_labels()
right.legend(h1 + h2, l1 + l2, loc="upper right", framealpha=0.95, fontsize=11.5)

fig.suptitle(f"Lesson 10: mixed-precision training, data parallel over {dp} ranks (lesson 08's model, ZeRO-{zero})",
             fontsize=16)
fig.tight_layout()
fig.savefig(dst)
plt.close(fig)
print(f"wrote {dst}")
