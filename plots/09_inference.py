"""Lesson 09's figures, from the lesson's --csv (scripts/make-plots.sh runs it first).

usage: 09_inference.py CACHE_CSV SPEED_CSV MOE_CSV OUTDIR
  CACHE_CSV  the default run's: kind=cache rows (numbers kept per token per layer, measured)
  SPEED_CSV  --speed runs of a larger model: kind=speed rows (float32, and int8=1)
  MOE_CSV    4-rank runs under --link, both MoE exchanges, several batch sizes: kind=decode rows
Writes OUTDIR/09_cache.png (what each cache keeps per token, this model's measured and
DeepSeek-V3's, and DeepSeek-V3's cache of one sequence against its length),
OUTDIR/09_speed.png (decode tokens/s against the batch size, under the roofline the measured
read bandwidth allows), OUTDIR/09_moe.png (the MoE's communication per decode step, all-to-all
against all-reduce)."""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if len(sys.argv) != 5:
    sys.exit(__doc__)
cache_csv, speed_csv, moe_csv, out = sys.argv[1:]


def rows(path, kind):
    got = [r for r in csv.DictReader(open(path)) if r["kind"] == kind]
    if not got:
        sys.exit(f"error: {path} has no kind={kind} rows")
    return got


KINDS = ["kv", "latent", "absorbed"]
COLORS = {"kv": "#c44e52", "latent": "#4c72b0", "absorbed": "#55a868"}

# ---- 09_cache.png
cache = {r["cache"]: r for r in rows(cache_csv, "cache")}
fig, (left, right) = plt.subplots(1, 2, figsize=(12.8, 7.2), dpi=100)
kinds = [k for k in KINDS if k in cache]
x = range(len(kinds))
here = [float(cache[k]["bytes_measured"]) for k in kinds]
v3 = [2 * float(cache[k]["floats_v3"]) for k in kinds]  # bf16
width = 0.38
left.bar([i - width / 2 for i in x], here, width, color=[COLORS[k] for k in kinds], label="this model, measured (float32)")
left.bar([i + width / 2 for i in x], v3, width, color=[COLORS[k] for k in kinds], alpha=0.45, hatch="//",
         label="DeepSeek-V3 (bf16)")
for i, k in enumerate(kinds):
    left.text(i - width / 2, here[i] * 1.15, f"{here[i]:.0f} B", ha="center", fontsize=11)
    left.text(i + width / 2, v3[i] * 1.15, f"{v3[i]:,.0f} B", ha="center", fontsize=11)
left.set_yscale("log")
left.set_xticks(list(x))
left.set_xticklabels(["kv\n(per-head K, V)", "latent\n(c_kv, k_pe)", "absorbed\n(c_kv, k_pe)"], fontsize=12)
left.set_ylabel("bytes per token per layer")
left.set_title("what each layer keeps per token")
left.legend(fontsize=11, loc="upper right")
left.set_ylim(50, 1e6)
lengths = [2 ** k for k in range(10, 18)]
for k in ["kv", "latent"]:
    per_token = 2 * float(cache[k]["floats_v3"]) * 61  # bf16, 61 layers
    right.loglog(lengths, [n * per_token / 2 ** 30 for n in lengths], "o-", color=COLORS[k],
                 label=f"{k}: {per_token / 1024:,.1f} KiB per token")
right.axhline(80e9 / 2 ** 30, color="black", lw=1, ls=":")
right.text(lengths[0], 85, "80 GB: one H800's memory", fontsize=11)
right.set_xlabel("context length (tokens)")
right.set_ylabel("GiB per sequence")
right.set_title("DeepSeek-V3: one sequence's cache, 61 layers")
right.legend(fontsize=12)
fig.suptitle("Lesson 09: MLA caches r_kv + d_rope numbers per token where multi-head attention keeps H (d_n + d_r + d_v)")
fig.tight_layout()
fig.savefig(f"{out}/09_cache.png")
print(f"wrote {out}/09_cache.png")

# ---- 09_speed.png
speed = rows(speed_csv, "speed")
fig, (top, bottom) = plt.subplots(2, 1, figsize=(12.8, 7.2), dpi=100, sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1]})
for int8, color, name in (("0", "#4c72b0", "float32"), ("1", "#dd8452", "int8 (FFNs and experts read int8)")):
    rs = sorted((r for r in speed if r["int8"] == int8), key=lambda r: int(r["batch"]))
    if not rs:
        continue
    b = [int(r["batch"]) for r in rs]
    top.loglog(b, [float(r["tokens_per_s"]) for r in rs], "o-", color=color, label=f"{name}: measured")
    # the roofline: reading the step's bytes at the measured bandwidth
    roof = [int(r["batch"]) * float(r["bandwidth"]) / (float(r["weight_bytes"]) + float(r["cache_bytes"])) for r in rs]
    top.loglog(b, roof, "--", color=color, alpha=0.7, label=f"{name}: roofline, batch x bandwidth / bytes read per step")
    bottom.semilogx(b, [100 * float(r["gb_per_s"]) / float(r["bandwidth"]) for r in rs], "o-", color=color)
top.set_ylabel("decode tokens/s")
top.legend(fontsize=11)
top.set_title(f"Lesson 09: decode speed, one process, against the memory roofline "
              f"(read bandwidth {float(speed[0]['bandwidth']) / 1e9:.1f} GB/s, measured)")
bottom.set_ylabel("bandwidth used (%)")
bottom.set_xlabel("batch size (sequences decoded together)")
fig.tight_layout()
fig.savefig(f"{out}/09_speed.png")
print(f"wrote {out}/09_speed.png")

# ---- 09_moe.png
moe = rows(moe_csv, "decode")
fig, ax = plt.subplots(figsize=(12.8, 7.2), dpi=100)
for how, color in (("alltoall", "#c44e52"), ("allreduce", "#4c72b0")):
    rs = sorted((r for r in moe if r["moe_comm"] == how), key=lambda r: int(r["batch"]))
    if not rs:
        continue
    b = [int(r["batch"]) for r in rs]
    ax.semilogx(b, [1e3 * float(r["moe_comm_s"]) / int(r["steps"]) for r in rs], "o-", color=color,
                label=f"MoE {how}: its communication per step")
    ax.semilogx(b, [1e3 * float(r["seconds"]) / int(r["steps"]) for r in rs], "o:", color=color, alpha=0.6,
                label=f"MoE {how}: the whole step")
ax.set_xlabel("batch size")
ax.set_ylabel("ms per decode step")
ax.set_title(f"Lesson 09: the MoE's tokens at decode, all-to-all (DeepEP) or all-reduce (DeepSeek-V3's model.py), "
             f"{moe[0]['ranks']} ranks, links modelled")
ax.set_ylim(bottom=0)
ax.legend(fontsize=11)
fig.tight_layout()
fig.savefig(f"{out}/09_moe.png")
print(f"wrote {out}/09_moe.png")
