"""Lesson 08's checkpoint figure: a run stopped and resumed on another mesh, over the run that
never stopped (scripts/make-plots.sh runs the three first).

usage: 08_checkpoint.py WHOLE_CSV FIRST_CSV RESUMED_CSV OUTDIR
  WHOLE_CSV    --csv of the uninterrupted run (every step logged)
  FIRST_CSV    --csv of the same run stopped halfway, with --save
  RESUMED_CSV  --csv of the run resumed from that checkpoint on another mesh
The kind=step rows are used: each step's loss (loss_mesh) and the one-process loss from the same
weights on the checked steps (loss_ref). Writes OUTDIR/08_checkpoint.png: the three loss
curves overlaid, and below, on a log scale, how far the stopped and the resumed run are from
the uninterrupted one step by step (0 before the stop: the same run; after it, the resumed mesh
sums in another order, rounding-sized differences that training carries on)."""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if len(sys.argv) != 5:
    sys.exit(__doc__)
whole_csv, first_csv, resumed_csv, out = sys.argv[1:]


def steps(path):
    """{step: loss_mesh} and the mesh's (dp, tp) of the kind=step rows."""
    rows = [r for r in csv.DictReader(open(path)) if r["kind"] == "step"]
    if not rows:
        sys.exit(f"error: {path} has no kind=step rows")
    mesh = f"DP {rows[0]['dp']} x TP {rows[0]['tp']}" if int(rows[0]["dp"]) * int(rows[0]["tp"]) > 1 else "1 process"
    return {int(r["step"]): float(r["loss_mesh"]) for r in rows}, mesh


whole, whole_mesh = steps(whole_csv)
first, first_mesh = steps(first_csv)
resumed, resumed_mesh = steps(resumed_csv)
stop = max(first) + 1
fig, (top, bottom) = plt.subplots(2, 1, figsize=(12.8, 7.2), dpi=100, sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1]})
top.plot(sorted(whole), [whole[s] for s in sorted(whole)], color="#888888", lw=4, alpha=0.6,
         label=f"never stopped ({whole_mesh})")
top.plot(sorted(first), [first[s] for s in sorted(first)], color="#4c72b0", lw=1.5,
         label=f"stopped after {stop} steps, saved ({first_mesh})")
top.plot(sorted(resumed), [resumed[s] for s in sorted(resumed)], color="#dd8452", lw=1.5,
         label=f"resumed on {resumed_mesh}")
top.axvline(stop - 0.5, color="black", lw=1, ls=":")
top.set_ylabel("training loss")
top.legend(fontsize=12)
top.set_title("Lesson 08: a run saved, stopped and resumed on another mesh, over the run that never stopped")
for run, color in ((first, "#4c72b0"), (resumed, "#dd8452")):
    xs = [s for s in sorted(run) if s in whole]
    bottom.semilogy(xs, [max(abs(run[s] - whole[s]), 1e-9) for s in xs], ".", color=color, ms=6)
bottom.axvline(stop - 0.5, color="black", lw=1, ls=":")
bottom.set_ylabel("|loss - never stopped|\n(1e-9: equal)")
bottom.set_xlabel("step")
fig.tight_layout()
fig.savefig(f"{out}/08_checkpoint.png")
print(f"wrote {out}/08_checkpoint.png")
