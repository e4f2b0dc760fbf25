"""The scale-out table of runs of one recipe at 1 and N ranks (same seed, same global batch).

    python scripts/offline/scaleout_table.py RUN_1GPU RUN_NGPU [...] [--skip 1]

Per run (from metrics.jsonl + config.yaml, the first `--skip` steps left out as warm-up): ranks, mean step
seconds and its split (generate / train / publish / other), samples/s (completions generated per second of
step), speed-up over the first run, the gradient all-reduce seconds and their share of the step, the wait
for the slowest rank, and whether the ranks' adapter checksums were equal every step (the job checks it and
stops otherwise; here: present on every step). Also says whether the runs trained on the same batches
(rollout statistics and token counts equal step by step, with `rl.sample_seeding: prompt`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

SAME_BATCH_KEYS = ("rollout/groups_generated", "rollout/groups_kept", "reward/mean", "response/length_mean",
                   "train/tokens", "data/cursor")


def load(run: Path) -> tuple[dict, list[dict]]:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return cfg, rows


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else 0.0


def summarize(run: Path, skip: int) -> dict:
    cfg, rows = load(run)
    measured = rows[skip:] or rows
    G = cfg["rl"]["samples_per_prompt"]
    step = mean(measured, "time/step_s")
    samples = statistics.fmean(r["rollout/groups_generated"] * G / r["time/step_s"] for r in measured)
    has_checksum = [("dist/adapter_checksum" in r) for r in rows]
    split = {phase: mean(measured, f"time/{phase}_s") for phase in ("generate", "train", "publish")}
    return {
        "run": run.name, "steps": len(measured), "step_s": step, **split,
        "other_s": step - sum(split.values()), "samples_s": samples,
        "allreduce_s": mean(measured, "dist/grad_allreduce_s"), "wait_s": mean(measured, "dist/grad_wait_s"),
        "checksums": "every step" if all(has_checksum) else ("-" if not any(has_checksum) else "MISSING"),
        "rows": rows,
    }


def same_batches(a: list[dict], b: list[dict]) -> str:
    steps = min(len(a), len(b))
    for i in range(steps):
        for key in SAME_BATCH_KEYS:
            if key in a[i] and a[i].get(key) != b[i].get(key):
                return f"differ at step {a[i]['step']} ({key}: {a[i][key]} vs {b[i].get(key)})"
    return f"equal over {steps} steps"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the means")
    parser.add_argument("--labels", help="comma-separated labels (default: run folder names)")
    args = parser.parse_args()
    labels = args.labels.split(",") if args.labels else [r.name for r in args.runs]
    rows = [summarize(run, args.skip) for run in args.runs]
    base = rows[0]["samples_s"]
    print("| run | steps | step s | generate s | train s | publish s | other s | samples/s | speed-up | "
          "all-reduce s | all-reduce % of step | wait for slowest rank s | checksums equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, r in zip(labels, rows):
        share = 100 * r["allreduce_s"] / r["step_s"] if r["step_s"] else 0.0
        print(f"| {label} | {r['steps']} | {r['step_s']:.2f} | {r['generate']:.2f} | {r['train']:.2f} | "
              f"{r['publish']:.3f} | {r['other_s']:.2f} | {r['samples_s']:.1f} | {r['samples_s'] / base:.2f}x | "
              f"{r['allreduce_s']:.4f} | {share:.2f} % | {r['wait_s']:.3f} | {r['checksums']} |")
    for label, r in zip(labels[1:], rows[1:]):
        print(f"batches of {labels[0]} and {label}: {same_batches(rows[0]['rows'], r['rows'])}")


if __name__ == "__main__":
    main()
