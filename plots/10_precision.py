"""Lesson 10's figure, from the lesson's --csv (scripts/make-plots.sh runs it first).

usage: 10_precision.py CSV OUTDIR
  CSV  rows k,m,n,promote,acc_bits,recipe,recipe_ratio,never,fp32_acc,fine,per_tensor: one per
       K of the FP8 sweep, from three runs with --acc-bits 14 (the H800's, the lesson's
       default), 13 and 15, the same --k-max (a later row of the same K and width wins)
Writes OUTDIR/10_fp8_error.png. Left: the FP8 e4m3 GEMM's relative error against float64 of its
own dequantized operands, against K (log-log): DeepSeek-V3's recipe (1 x 128 and 128 x 128
tiles, the partial sum promoted every 128 products), the same GEMM never promoted (one scale
along K, all K products in the narrow accumulator), the recipe with a float32 accumulator; the
shading spans an accumulator of 13 to 15 bits, the lines are 14. The star is the report's claim
(section 3.3.2): nearly 2% at K = 4096 without promotion. Right: activations with outlier
channels (every 256th, x the lesson's --outlier, 10^4 by default), per-tile scales against one
scale per tensor, against float64 of the float32 inputs (so e4m3's rounding of the inputs is in
both)."""
import csv
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
BITS = (13, 14, 15)  # the accumulator widths make-plots.sh runs; 14 is the lines, 13..15 the bands
with open(src) as f:
    reader = csv.DictReader(f)
    missing = [c for c in NEED if c not in (reader.fieldnames or [])]
    if missing:
        sys.exit(f"error: {src} has no column(s) {', '.join(missing)}: run 10_precision with --csv")
    runs = {}  # acc_bits -> K -> row
    for r in reader:
        runs.setdefault(int(r["acc_bits"]), {})[int(r["k"])] = r
for bits in (14, 13, 15):
    if len(runs.get(bits, {})) < 2:
        sys.exit(f"error: {src} has {len(runs.get(bits, {}))} rows with acc_bits={bits}, at least 2 needed "
                 f"(make-plots.sh runs 10_precision --k-max 16384 --acc-bits 13, 14 and 15 with --csv)")
ks = sorted(runs[14])
for bits in BITS:
    if sorted(runs[bits]) != ks:
        sys.exit(f"error: {src}: the acc_bits={bits} rows have K = {sorted(runs[bits])}, the acc_bits=14 rows "
                 f"{ks}: run all three with the same --k-max")
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
print(f"wrote {dst}")
