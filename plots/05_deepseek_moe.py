"""Lesson 05's figures, from its --csv output (scripts/make-plots.sh runs the lesson first).

usage: 05_deepseek_moe.py LAYER_CSV TRAIN_CSV OUTDIR
  LAYER_CSV  rows `series,P,a,b,c` of the layer runs at P = 8 with M = 2 and M = 4 groups:
             load (a expert, b node, c slots), nodes (a M, b nodes reached, c tokens),
             bytes (a scheme, b link class + "-M" + M, c bytes of the forward)
  TRAIN_CSV  rows `series,P,balance,bug,step,loss,balance_loss,max_over_mean,dropped` of the
             --train runs
writes OUTDIR/05_deepseek_moe_routing.png (tokens -> nodes -> experts), 05_deepseek_moe_bytes.png
(bytes per link class, flat vs hierarchical) and 05_deepseek_moe_balance.png (load imbalance and
loss over training)."""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if len(sys.argv) != 4:
    sys.exit(__doc__)
layer_csv, train_csv, out = sys.argv[1:]
plt.rcParams.update({"font.size": 15, "axes.titlesize": 17, "axes.labelsize": 15,
                     "legend.fontsize": 13, "xtick.labelsize": 13, "ytick.labelsize": 13})
FIG = dict(figsize=(12.8, 7.2), dpi=100)
rows = list(csv.DictReader(open(layer_csv)))

# ---- routing: how many nodes a token reaches (with and without the node limit), and the
# loads of the experts, coloured by the node that holds them
fig, (ax1, ax2) = plt.subplots(1, 2, **FIG, gridspec_kw={"width_ratios": [1, 1.6]})
reach = defaultdict(dict)
for r in rows:
    if r["series"] == "nodes":
        reach[int(r["a"])][int(r["b"])] = int(r["c"])
Ms = sorted(reach)
width = 0.8 / max(len(Ms), 1)
for i, M in enumerate(Ms):
    ks = sorted(reach[M])
    total = sum(reach[M].values())
    ax1.bar([k + (i - (len(Ms) - 1) / 2) * width for k in ks],
            [reach[M][k] / total for k in ks], width,
            label=f"M = {M}" + (" (no limit)" if M == max(Ms) else " (node-limited)"))
ax1.set_xlabel("nodes a token's experts are on")
ax1.set_ylabel("fraction of tokens")
ax1.set_title("tokens -> nodes")
ax1.legend(loc="upper left")
loads = [(int(r["a"]), int(r["b"]), int(r["c"])) for r in rows if r["series"] == "load"]
first_M = [l for l in loads[:len(loads) // max(len(Ms), 1)]]
colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
ax2.bar([e for e, _, _ in first_M], [c for _, _, c in first_M],
        color=[colors[n % len(colors)] for _, n, _ in first_M])
mean = sum(c for _, _, c in first_M) / max(len(first_M), 1)
ax2.axhline(mean, color="k", ls="--", lw=1)
ax2.text(len(first_M) - 0.5, mean, " mean", va="bottom", ha="right")
ax2.set_xlabel("expert (colour: the node holding it)")
ax2.set_ylabel("routing slots")
ax2.set_title(f"nodes -> experts (M = {Ms[0] if Ms else '?'})")
fig.suptitle("Lesson 05: node-limited routing, P = 8 ranks = 4 nodes x 2")
fig.tight_layout()
fig.savefig(f"{out}/05_deepseek_moe_routing.png")
plt.close(fig)

# ---- bytes per link class
fig, ax = plt.subplots(**FIG)
b = {(r["a"], r["b"]): int(r["c"]) for r in rows if r["series"] == "bytes"}
cases = [(s, M) for M in Ms for s in ("flat", "hierarchical")]
xs = range(len(cases))
intra = [b.get((s, f"intra-M{M}"), 0) / 1024 for s, M in cases]
inter = [b.get((s, f"inter-M{M}"), 0) / 1024 for s, M in cases]
ax.bar([x - 0.2 for x in xs], intra, 0.4, label="intra-node (NVLink)")
ax.bar([x + 0.2 for x in xs], inter, 0.4, label="inter-node (InfiniBand)")
for x, v in zip(xs, inter):
    ax.text(x + 0.2, v, f"{v:.0f}", ha="center", va="bottom")
ax.set_xticks(list(xs))
ax.set_xticklabels([f"{s}\nM = {M}" for s, M in cases])
ax.set_ylabel("KiB, one forward (dispatch + combine), all ranks")
ax.set_title("Lesson 05: bytes per link class, flat vs hierarchical all-to-all (P = 8, 4 nodes)")
ax.legend()
fig.tight_layout()
fig.savefig(f"{out}/05_deepseek_moe_bytes.png")
plt.close(fig)

# ---- balancing over training
runs = defaultdict(list)
for r in csv.DictReader(open(train_csv)):
    if r["series"] == "train":
        name = r["balance"] + ("" if r["bug"] == "none" else f" + bug {r['bug']}")
        runs[name].append((int(r["step"]), float(r["max_over_mean"]), float(r["loss"])))
fig, (ax1, ax2) = plt.subplots(1, 2, **FIG)
def smooth(v, w=20):  # trailing mean over w steps: one step's loads are noisy
    return [sum(v[max(0, i - w + 1):i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(v))]


for name, pts in runs.items():
    pts.sort()
    steps = [p[0] for p in pts]
    line, = ax1.plot(steps, smooth([p[1] for p in pts]), label=name, lw=2)
    ax1.plot(steps, [p[1] for p in pts], color=line.get_color(), lw=0.5, alpha=0.25)
    ax2.plot(steps, smooth([p[2] for p in pts]), label=name, lw=2)
ax1.axhline(1, color="k", lw=0.8)
ax1.set_xlabel("step")
ax1.set_ylabel("max / mean expert load")
ax1.set_title("load imbalance (20-step mean; faint: each step)")
ax1.legend()
ax2.set_xlabel("step")
ax2.set_ylabel("cross-entropy (nats per character)")
ax2.set_title("training loss (20-step mean)")
fig.suptitle("Lesson 05: balancing a tiny MoE language model on tinyshakespeare")
fig.tight_layout()
fig.savefig(f"{out}/05_deepseek_moe_balance.png")
plt.close(fig)
