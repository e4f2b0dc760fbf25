"""The study's outputs: `summary.md` (one table, a row per pairing), `summary.json`, `curves.png`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from epirl.compare.collect import FINAL_STEPS, RunResult
from epirl.compare.plan import StudyPlan

COLUMNS = ("pairing", "engine · trainer · correction", "runs finished", "probe stops", "held-out accuracy [95% CI]",
           "per seed", "Δ vs {reference}, problems [95% CI]", "Δ vs {reference}, seeds [95% CI]",
           f"final reward (last {FINAL_STEPS} steps)", "KL(engine‖trainer) median", "KL ÷ {reference}",
           "bitwise-equal log-probs (lowest step)", "TIS clip frac", "β vs old: median (worst)",
           "β vs base: median (worst)", "s/step (generate · train · probe)", "peak memory GiB")
CURVES = (("reward/mean", "training reward (mean)", "linear"),
          ("mismatch/k3_kl", "KL(engine‖trainer), k3 estimate", "log"))


def _number(value, spec: str = "{:.3f}") -> str:
    return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else spec.format(value)


def _interval(block: dict | None, signed: bool = False) -> str:
    if not block:
        return "–"
    spec = "{:+.3f}" if signed else "{:.3f}"
    return f"{spec.format(block['estimate'])} [{spec.format(block['ci_low'])}, {spec.format(block['ci_high'])}]"


def _arrival(block: dict) -> str:
    if block["median"] is None:
        return "– (none resolved)"
    return f"{block['median']:.2f} ({block['worst']:.2f}), {block['resolved_steps']} steps"


def _seconds(phases: dict) -> str:
    if phases.get("step") is None:
        return "–"
    parts = " · ".join(_number(phases.get(phase), "{:.1f}") for phase in ("generate", "train", "probe"))
    return f"{phases['step']:.1f} ({parts})"


def _memory(peaks: dict) -> str:
    """The trainer process's GPU peak (torch allocator) where there is a GPU, else the host's peak RSS."""
    if peaks.get("gpu_peak_gib") is not None:
        return f"GPU {peaks['gpu_peak_gib']:.1f}"
    if peaks.get("cpu_peak_rss_gib") is not None:
        return f"host RSS {peaks['cpu_peak_rss_gib']:.1f}"
    return "–"


def _probe_stops(summary: dict) -> str:
    stops = summary["probe_stops"]
    if not stops:
        return "none"
    return f"**{len(stops)}**: " + ", ".join(f"s{stop['seed']} at step {stop['step']}" for stop in stops)


def table_row(name: str, summary: dict) -> list[str]:
    heldout = summary.get("heldout") or {}
    return [name, f"{summary['engine']} · {summary['trainer_base']} · {summary['correction']}",
            f"{summary['finished']}/{summary['runs']}", _probe_stops(summary), _interval(heldout.get("accuracy")),
            " / ".join(f"{value:.3f}" for value in (heldout.get("per_seed") or {}).values()) or "–",
            _interval(heldout.get("vs_reference"), signed=True),
            _interval(heldout.get("vs_reference_over_seeds"), signed=True), _number(summary["final_reward"], "{:+.3f}"),
            _number(summary["kl_median"], "{:.2e}"), _number(summary["kl_vs_reference"], "{:.2f}×"),
            _number(summary["bitwise_frac_lowest"], "{:.4f}"),
            _number(summary["tis_clipped_frac"], "{:.2%}"), _arrival(summary["probe_arrival_vs_old"]),
            _arrival(summary["probe_arrival_vs_base"]), _seconds(summary["seconds_per_step"]),
            _memory(summary["memory_peak"])]


def markdown_table(plan: StudyPlan, summaries: dict[str, dict]) -> str:
    header = [column.format(reference=plan.spec.reference) for column in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(table_row(name, summary)) + " |" for name, summary in summaries.items()]
    return "\n".join(lines)


def notes(plan: StudyPlan) -> list[str]:
    spec = plan.spec
    steps = plan.runs[0].config.rl.steps
    lines = [f"Recipe {spec.recipe}, {len(spec.seeds)} seed(s) ({', '.join(map(str, spec.seeds))}) per pairing, "
             f"{steps} steps per run; runs in {plan.runs_dir}."]
    if plan.split is not None:
        engine = "its own engine precision" if spec.eval_engine == "run" else f"a {spec.eval_engine} engine"
        lines.append(f"Held-out: {plan.split.describe()}; each adapter answers once (greedy) on {engine}. Intervals: "
                     f"{spec.confidence:.0%} percentile bootstrap over problems ({spec.resamples} resamples; problems "
                     "resampled, seeds averaged: another draw of problems), Δ paired on the same problems; Δ over "
                     "seeds: Welch's t-interval on the per-seed accuracies (another draw of training seeds, the wider "
                     "one to read).")
    else:
        lines.append("Held-out: none (the recipe does not train on data.source: arithmetic).")
    lines.append("KL and TIS clip: median / mean over the steps with an update, then the mean over seeds. β: the "
                 "probe's arrival fraction on the steps it resolved (1 = the engine serves the new adapter; worst = "
                 "farthest from 1), pooled over seeds. Seconds: median per step, mean over seeds. Memory: the largest "
                 "over steps and seeds of the trainer process's torch peak (GPU) or the host's peak RSS.")
    if spec.runs_per_gpu > 1:
        lines.append(f"Runs shared each GPU {spec.runs_per_gpu} at a time (--runs-per-gpu): the seconds are those of "
                     "runs beside each other, not of a run alone.")
    return lines


def summary_json(plan: StudyPlan, results: list[RunResult], summaries: dict[str, dict]) -> dict:
    spec = plan.spec
    return {
        "command": spec.command_line, "recipe": str(spec.recipe), "name": plan.base_config.name,
        "seeds": list(spec.seeds), "steps": plan.runs[0].config.rl.steps, "reference": spec.reference,
        "runs_per_gpu": spec.runs_per_gpu,
        "heldout": None if plan.split is None else {
            "file": str(plan.split.heldout_file), "problems": len(plan.split.heldout), "engine": spec.eval_engine,
            "decoding": "greedy, one answer per problem", "confidence": spec.confidence, "resamples": spec.resamples,
            "training_problems": {str(seed): len(p) for seed, p in plan.split.training_by_seed.items()}},
        "pairings": summaries,
        "runs": [{"name": r.name, "pairing": r.pairing, "seed": r.seed, "state": r.state, "steps": r.steps_done,
                  "steps_planned": r.steps_planned, "stopped_by_probe": r.state == "stopped",
                  "heldout_accuracy": (sum(r.heldout.values()) / len(r.heldout)) if r.heldout else None,
                  "run_dir": str(r.run_dir)} for r in results],
    }


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_summary(plan: StudyPlan, results: list[RunResult], summaries: dict[str, dict]) -> str:
    """summary.md, summary.json and curves.png in the study folder; returns the markdown table."""
    table = markdown_table(plan, summaries)
    title = f"# epirl compare: {plan.base_config.name}\n\n`{plan.spec.command_line}`\n\n" if plan.spec.command_line \
        else f"# epirl compare: {plan.base_config.name}\n\n"
    bullets = "\n".join(f"- {note}" for note in notes(plan))
    _atomic_write(plan.study_dir / "summary.md", f"{title}{table}\n\n{bullets}\n")
    document = summary_json(plan, results, summaries)
    _atomic_write(plan.study_dir / "summary.json", json.dumps(document, indent=1, allow_nan=False,
                                                              default=_json_value) + "\n")
    write_curves(results, plan.study_dir / "curves.png", plan.base_config.name)
    return table


def _json_value(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")


# ------------------------------------------------------------------------------------------------ curves.png
def band_over_seeds(results: list[RunResult], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean over seeds, standard deviation over seeds) of one metric; steps where no seed has a value are left
    out, and a step with one seed's value has no band."""
    by_step: dict[int, list[float]] = {}
    for result in results:
        for row in result.rows:
            value = row.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                by_step.setdefault(int(row["step"]), []).append(float(value))
    steps = np.array(sorted(by_step), dtype=float)
    means = np.array([np.mean(by_step[int(step)]) for step in steps])
    spread = np.array([np.std(by_step[int(step)], ddof=1) if len(by_step[int(step)]) > 1 else 0.0 for step in steps])
    return steps, means, spread


def write_curves(results: list[RunResult], path: Path, title: str = "") -> Path:
    """Reward and KL against step: per pairing the mean over seeds and a ±1 standard deviation band."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    axes = figure.subplots(1, len(CURVES))
    pairings = list(dict.fromkeys(result.pairing for result in results))
    for ax, (key, label, scale) in zip(axes, CURVES):
        positive, smallest = True, math.inf
        for pairing in pairings:
            steps, means, spread = band_over_seeds([r for r in results if r.pairing == pairing], key)
            if steps.size == 0:
                continue
            line, = ax.plot(steps, means, marker="o", markersize=2.5, linewidth=1.5, label=pairing)
            ax.fill_between(steps, means - spread, means + spread, color=line.get_color(), alpha=0.2, linewidth=0)
            positive = positive and bool(np.all(means - spread > 0))
            smallest = min([smallest, *means[means > 0]])
        if scale == "log" and ax.lines:  # zeros (a bitwise pairing's KL) or bands below zero: linear around 0 only
            if positive:
                ax.set_yscale("log")
            else:
                ax.set_yscale("symlog", linthresh=min(smallest, 1.0) / 10, linscale=0.3)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes, color="gray")
    figure.suptitle(f"{title}: mean ± 1 s.d. over seeds" if title else "mean ± 1 s.d. over seeds", fontsize=11)
    tmp = path.with_name(path.name + ".tmp.png")
    figure.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return path
