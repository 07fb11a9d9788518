"""Summarise the drift.yaml learning-rate sweep (seeds 0-2) and the held-out seeds 5-9 and plot it.

    .venv/bin/python docs/drift-lr-sweep/summarise.py PLOT.png [ROOT]
"""
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from apps.experiments.intervals import interval, cell

ROOT = sys.argv[2] if len(sys.argv) > 2 else "/tmp/x"
"""Where the runs were written (one directory per cell, seed-k below each; sao at 3e-4 in ROOT/new)."""
cells = {("sao", 1.5e-4): f"{ROOT}/sao_lr1.5e-4", ("sao", 3e-4): f"{ROOT}/new", ("sao", 6e-4): f"{ROOT}/sao_lr6e-4",
         ("running_mean_w128", 1.5e-4): f"{ROOT}/rm_lr1.5e-4", ("running_mean_w128", 3e-4): f"{ROOT}/rm_lr3e-4",
         ("running_mean_w128", 6e-4): f"{ROOT}/rm_lr6e-4"}
rows, points = [], {}
for (arm, lr), d in cells.items():
    a = json.load(open(f"{d}/report/report.json"))[0]
    per = [s["post_switch_mean"] for s in a["per_seed"]][:3]  # seeds 0-2 (the sao 3e-4 run has 0-4)
    points[(arm, lr)] = per
    rows.append(f"| {arm} | {lr:g} | {cell(interval(per))} | {', '.join(f'{v:.3f}' for v in per)} |")
print("| arm | policy_lr | post-switch mean, seeds 0-2 | per seed |\n|---|---|---|---|")
print("\n".join(rows))
held = json.load(open("docs/drift-critic/ten-seeds/sao-and-running-mean/report.json"))
h = {a["name"]: [s["post_switch_mean"] for s in a["per_seed"]][5:] for a in held}
print()
for arm, v in h.items():
    print(f"held-out seeds 5-9 at 3e-4: {arm} {cell(interval(v))} per seed {', '.join(f'{x:.3f}' for x in v)}")
diff = [a - b for a, b in zip(h["sao"], h["running_mean_w128"])]
print(f"paired sao - running_mean_w128 over seeds 5-9: {cell(interval(diff))}")
fig, ax = plt.subplots(figsize=(6, 4))
for arm, colour, shift in (("sao", "tab:blue", 0.97), ("running_mean_w128", "tab:orange", 1.03)):
    lrs = [1.5e-4, 3e-4, 6e-4]
    means = [sum(points[(arm, lr)]) / 3 for lr in lrs]
    ax.plot([lr * shift for lr in lrs], means, "-o", color=colour, label=f"{arm} (mean of seeds 0-2)")
    for lr in lrs:
        ax.scatter([lr * shift] * 3, points[(arm, lr)], color=colour, alpha=0.35, s=14)
ax.set_xscale("log"); ax.set_xlabel("policy_lr"); ax.set_ylabel("post-switch mean reward")
ax.set_title("drift.yaml, in process: the same policy-rate sweep for both arms")
ax.legend(fontsize=8); fig.tight_layout(); fig.savefig(sys.argv[1], dpi=120)
