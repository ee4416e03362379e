"""Lesson 03 figure, 03_smoe.png, from the lesson's --csv (series,gate,N,k,T,a,b,c; the last
run in the file is drawn).

Left: routing slots per expert (series "tokens": a = expert, b = slots), against the uniform
share T k / N. The load-balance loss is what pushes the bars toward that line.
Right: permute -> grouped GEMM -> unpermute, drawn from the real routing of the first tokens
(series "route": a = slot s = t k + j, b = its expert, c = its packed row). On the left the
slots in token order, colored by expert; each goes to its row of the packed buffer on the
right, where the rows of one expert are contiguous (a counting sort by expert, stable in slot
order). Each group is multiplied by its own expert's weights in one grouped GEMM; unpermute
reads the rows back through the same lines, weighted by the gates.

usage: 03_smoe.py CSV OUT_DIR
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

if len(sys.argv) != 3:
    sys.exit("usage: 03_smoe.py CSV OUT_DIR")
src, out = sys.argv[1], sys.argv[2]
SHOW_SLOTS = 24  # about 12 tokens at k = 2

# ---- the last run: a run starts at its "tokens" row of expert 0 (the lesson appends runs)
runs = []
with open(src) as f:
    for row in csv.DictReader(f):
        if row["series"] == "tokens" and int(row["a"]) == 0:
            runs.append({"meta": row, "tokens": {}, "route": []})
        if not runs:
            continue
        if row["series"] == "tokens":
            runs[-1]["tokens"][int(row["a"])] = int(row["b"])
        elif row["series"] == "route":
            runs[-1]["route"].append((int(row["a"]), int(row["b"]), int(row["c"])))
if not runs or not runs[-1]["route"]:
    sys.exit(f"error: {src} has no 'tokens' and 'route' rows; run 03_smoe with --csv")
run = runs[-1]
meta = run["meta"]
N, k, T, gate = int(meta["N"]), int(meta["k"]), int(meta["T"]), meta["gate"]
sizes = [run["tokens"].get(e, 0) for e in range(N)]
route = sorted(run["route"])  # by slot
M = T * k
show_tokens = max(1, min(T, SHOW_SLOTS // k))
cmap = plt.get_cmap("tab10" if N <= 10 else "tab20")
color = lambda e: cmap(e % cmap.N)


def ink(e):  # black text on light colors, white on dark ones
    r, g, b, _ = color(e)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12.8, 7.2), dpi=100,
                               gridspec_kw={"width_ratios": [1, 1.35]})

# ---- left: slots per expert
ax1.bar(range(N), sizes, color=[color(e) for e in range(N)], edgecolor="black", lw=0.5)
uniform = M / N
ax1.axhline(uniform, color="black", ls="--", lw=1, label=f"uniform T·k/N = {uniform:.1f}")
for e, n in enumerate(sizes):
    ax1.text(e, n, str(n), ha="center", va="bottom", fontsize=10.8)
tick_every = 1 if N <= 16 else (N + 15) // 16
ax1.set_xticks(range(0, N, tick_every))
ax1.set_xticklabels([f"e{e}" for e in range(0, N, tick_every)], fontsize=10.8)
ax1.set_xlabel("expert")
ax1.set_ylabel("routing slots (token, choice)")
ax1.set_ylim(0, max(max(sizes), uniform) * 1.15)
ax1.set_title(f"Tokens per expert: {T} tokens, top-{k} of N={N}, {gate}", fontsize=13.5)
ax1.legend(loc="upper right", fontsize=10.8)

# ---- right: permute -> grouped GEMM -> unpermute
shown = [r for r in route if r[0] // k < show_tokens]
S = len(shown)
H = 1.0                     # both columns span the same height, top to bottom
slot_h, row_h = H / S, H / M
xs, xp, w = 0.0, 1.0, 0.18  # x of the slot column, of the packed column; column width
ys = lambda i: H - (i + 0.5) * slot_h   # center of the i-th shown slot
yp = lambda r: H - (r + 0.5) * row_h    # center of packed row r

# slots, in token order: one box each, a rule between tokens
for i, (s, e, r) in enumerate(shown):
    t, j = divmod(s, k)
    ax2.add_patch(Rectangle((xs - w, H - (i + 1) * slot_h), w, slot_h, facecolor=color(e),
                            edgecolor="white", lw=0.6))
    ax2.text(xs - w - 0.02, ys(i), f"t{t}.{j}", ha="right", va="center", fontsize=8.8)
    ax2.text(xs - w / 2, ys(i), f"e{e}", ha="center", va="center", fontsize=8.1, color=ink(e),
             fontweight="bold")
    if j == 0 and i > 0:
        ax2.plot([xs - w - 0.09, xs], [H - i * slot_h] * 2, color="black", lw=0.5)
# the packed buffer: every row (all T tokens), groups by expert with boundaries
off = 0
for e in range(N):
    n = sizes[e]
    if n:
        ax2.add_patch(Rectangle((xp, H - (off + n) * row_h), w, n * row_h, facecolor=color(e),
                                alpha=0.3, edgecolor="none"))
        if n * row_h > 0.022:
            ax2.text(xp + w + 0.02, H - (off + n / 2) * row_h, f"e{e}: rows {off}..{off + n - 1}",
                     ha="left", va="center", fontsize=8.8)
    ax2.plot([xp - 0.02, xp + w + 0.02], [H - off * row_h] * 2, color="black", lw=0.8)
    off += n
ax2.plot([xp - 0.02, xp + w + 0.02], [0, 0], color="black", lw=0.8)
# the shown slots' rows, and the permute: a line from each slot to its packed row
for i, (s, e, r) in enumerate(shown):
    ax2.add_patch(Rectangle((xp, H - (r + 1) * row_h), w, row_h, facecolor=color(e),
                            edgecolor="black", lw=0.3))
    ax2.annotate("", xy=(xp, yp(r)), xytext=(xs, ys(i)),
                 arrowprops=dict(arrowstyle="-|>", color=color(e), lw=0.8, alpha=0.85,
                                 shrinkA=0, shrinkB=0, mutation_scale=6))

plural = "s" if show_tokens > 1 else ""
ax2.text(xs - w / 2, H + 0.035, f"slots s = t·k + j\n(first {show_tokens} token{plural})",
         ha="center", va="bottom", fontsize=10.8)
ax2.text(xp + w / 2, H + 0.035,
         f"packed rows (all {M}), grouped by expert\n(faded: the other tokens' slots)",
         ha="center", va="bottom", fontsize=10.8)
ax2.text((xs + xp) / 2, -0.05, "permute: xp = x[src_token]  (counting sort by expert)\n"
         "grouped GEMM: each group × its expert's W1, W3, W2\n"
         "unpermute: y_t = Σ_j g_tj · yp[pos[t·k + j]]", ha="center", va="top", fontsize=10.8)
ax2.set_xlim(-0.55, 1.65)
ax2.set_ylim(-0.2, H + 0.12)
ax2.axis("off")
ax2.set_title("Permute → grouped GEMM → unpermute (the real routing)", fontsize=13.5)

fig.tight_layout()
fig.savefig(f"{out}/03_smoe.png")
print(f"wrote {out}/03_smoe.png")
