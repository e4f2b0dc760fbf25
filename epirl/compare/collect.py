"""What each run folder says (steps, probe, metrics, held-out verdicts) and what that makes per pairing.

Per run, from metrics.jsonl: the final training reward (mean `reward/mean` over the last FINAL_STEPS steps), the
median over steps of KL(engine‖trainer) (`mismatch/k3_kl`, steps with an update), the lowest step's fraction of
bitwise-equal log-probs (`mismatch/bitwise_frac`: 1.0 on every step is the bitwise pairing's bar), the mean TIS clip
fraction (`is/clipped_frac`), the probe's arrival fractions β (`probe/arrival_vs_old|base`) on the steps it resolved
(`probe/separation_vs_*` ≥ the run's engine.probe_separation), the median seconds per step of each phase
(`time/*_s`) and the largest value of every `mem/*` key. Per pairing: runs averaged over seeds, β pooled over
seeds, memory the largest over seeds, held-out accuracy and its paired difference as in epirl.compare.stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from epirl.compare import stats
from epirl.compare.plan import (PlannedRun, StudyPlan, eval_done, heldout_verdicts, is_finished, read_metric_rows,
                                stopped_by_probe)

FINAL_STEPS = 5
ARRIVAL_ALTERNATIVES = ("old", "base")


@dataclass
class RunResult:
    name: str
    pairing: str
    seed: int
    run_dir: Path
    state: str
    """`finished`, `stopped` (by the probe), `unfinished` (crashed or interrupted) or `missing`."""
    steps_done: int
    steps_planned: int
    rows: list[dict] = field(default_factory=list, repr=False)
    heldout: dict[str, bool] | None = None
    """Problem id → correct, for a finished run whose evaluation on the study's held-out set is complete."""

    @property
    def stop_step(self) -> int | None:
        """The step whose probe stopped the run (its row is never logged: the probe raised inside it)."""
        return self.steps_done + 1 if self.state == "stopped" else None

    def values(self, key: str) -> list:
        return [row.get(key) for row in self.rows]

    def metrics(self, separation: float) -> dict:
        time_keys = sorted({key for row in self.rows for key in row if key.startswith("time/")})
        mem_keys = sorted({key for row in self.rows for key in row if key.startswith("mem/")})
        summary = {
            "final_reward": stats.mean_or_none(self.values("reward/mean")[-FINAL_STEPS:]),
            "kl_median": stats.median_or_none(self.values("mismatch/k3_kl")),
            "bitwise_frac_lowest": min(stats.finite(self.values("mismatch/bitwise_frac")), default=None),
            "tis_clipped_frac": stats.mean_or_none(self.values("is/clipped_frac")),
            "seconds_per_step": {key.removeprefix("time/").removesuffix("_s"): stats.median_or_none(self.values(key))
                                 for key in time_keys},
            "memory_peak": {key.removeprefix("mem/"): max(stats.finite(self.values(key)), default=None)
                            for key in mem_keys},
        }
        for alt in ARRIVAL_ALTERNATIVES:
            summary[f"arrival_vs_{alt}"] = [row[f"probe/arrival_vs_{alt}"] for row in self.rows
                                            if (row.get(f"probe/separation_vs_{alt}") or 0.0) >= separation
                                            and f"probe/arrival_vs_{alt}" in row]
        return summary


def read_heldout(plan: StudyPlan, run: PlannedRun) -> dict[str, bool] | None:
    """The run's held-out verdicts, when they were made on this study's held-out set and eval engine."""
    if plan.split is None or not eval_done(plan, run):
        return None
    return heldout_verdicts(run.run_dir)


def collect_run(plan: StudyPlan, run: PlannedRun) -> RunResult:
    steps = run.config.rl.steps
    rows = read_metric_rows(run.run_dir)
    if not run.run_dir.exists():
        state = "missing"
    elif is_finished(run.run_dir, steps):
        state = "finished"
    else:
        state = "stopped" if stopped_by_probe(run.run_dir) else "unfinished"
    done = rows[-1]["step"] if rows else 0
    heldout = read_heldout(plan, run) if state == "finished" else None
    return RunResult(run.name, run.pairing.name, run.seed, run.run_dir, state, done, steps, rows, heldout)


def _mean_over_seeds(per_run: list[dict], key: str) -> float | None:
    return stats.mean_or_none([metrics[key] for metrics in per_run if metrics[key] is not None])


def _phase_seconds(per_run: list[dict]) -> dict[str, float]:
    phases = sorted({phase for metrics in per_run for phase in metrics["seconds_per_step"]})
    return {phase: stats.mean_or_none([m["seconds_per_step"].get(phase) for m in per_run]) for phase in phases}


def _memory_peak(per_run: list[dict]) -> dict[str, float]:
    keys = sorted({key for metrics in per_run for key in metrics["memory_peak"]})
    return {key: max(stats.finite([m["memory_peak"].get(key) for m in per_run]), default=None) for key in keys}


def _arrival(per_run: list[dict], alt: str) -> dict:
    betas = [beta for metrics in per_run for beta in metrics[f"arrival_vs_{alt}"]]
    return {"median": stats.median_or_none(betas), "worst": stats.worst_arrival(betas),
            "resolved_steps": len(stats.finite(betas))}


def heldout_matrix(results: list[RunResult], problem_ids: list[str]) -> tuple[list[int], np.ndarray | None]:
    """(the seeds evaluated, their [seeds, problems] correctness in `problem_ids` order), or no matrix."""
    evaluated = [result for result in results if result.heldout is not None]
    if not evaluated:
        return [], None
    matrix = np.array([[result.heldout.get(pid, False) for pid in problem_ids] for result in evaluated], dtype=float)
    return [result.seed for result in evaluated], matrix


def pairing_summary(plan: StudyPlan, name: str, results: list[RunResult]) -> dict:
    """Everything the table and summary.json say about one pairing (runs averaged over seeds)."""
    config = next(run.config for run in plan.runs if run.pairing.name == name)
    per_run = [result.metrics(config.engine.probe_separation) for result in results]
    summary = {
        "overrides": list(next(run.pairing.overrides for run in plan.runs if run.pairing.name == name)),
        "engine": config.engine.precision, "trainer_base": config.trainer.base, "correction": config.rl.correction,
        "runs": len(results), "finished": sum(result.state == "finished" for result in results),
        "probe_stops": [{"seed": r.seed, "step": r.stop_step} for r in results if r.state == "stopped"],
        "unfinished": [result.seed for result in results if result.state in ("unfinished", "missing")],
        "final_reward": _mean_over_seeds(per_run, "final_reward"),
        "kl_median": _mean_over_seeds(per_run, "kl_median"),
        "bitwise_frac_lowest": min(stats.finite([metrics["bitwise_frac_lowest"] for metrics in per_run]), default=None),
        "tis_clipped_frac": _mean_over_seeds(per_run, "tis_clipped_frac"),
        "seconds_per_step": _phase_seconds(per_run),
        "memory_peak": _memory_peak(per_run),
    }
    for alt in ARRIVAL_ALTERNATIVES:
        summary[f"probe_arrival_vs_{alt}"] = _arrival(per_run, alt)
    return summary


def heldout_summary(plan: StudyPlan, results_by_pairing: dict[str, list[RunResult]]) -> dict[str, dict]:
    """Per pairing: accuracy with its interval and per-seed values; the difference to the reference, paired on the
    problems (bootstrap) and over seeds (Welch)."""
    if plan.split is None:
        return {}
    spec, problem_ids = plan.spec, [problem.uid for problem in plan.split.heldout]
    matrices = {name: heldout_matrix(results, problem_ids) for name, results in results_by_pairing.items()}
    reference = matrices.get(spec.reference, ([], None))[1]
    out = {}
    for name, (seeds, matrix) in matrices.items():
        if matrix is None:
            out[name] = {"seeds_evaluated": [], "accuracy": None, "vs_reference": None,
                         "vs_reference_over_seeds": None}
            continue
        accuracy = stats.accuracy_interval(matrix, spec.resamples, spec.confidence)
        difference = over_seeds = None
        if reference is not None and name != spec.reference:
            difference = stats.paired_difference(matrix, reference, spec.resamples, spec.confidence)
            over_seeds = stats.seed_difference(matrix.mean(axis=1), reference.mean(axis=1), spec.confidence)
        out[name] = {"seeds_evaluated": seeds, "problems": len(problem_ids), "accuracy": accuracy.as_dict(),
                     "per_seed": {str(seed): float(row.mean()) for seed, row in zip(seeds, matrix)},
                     "vs_reference": difference.as_dict() if difference else None,
                     "vs_reference_over_seeds": over_seeds.as_dict() if over_seeds else None}
    return out


def collect_study(plan: StudyPlan) -> tuple[list[RunResult], dict[str, dict]]:
    """(every run's result, per pairing its summary with `heldout` filled in)."""
    results = [collect_run(plan, run) for run in plan.runs]
    by_pairing: dict[str, list[RunResult]] = {}
    for result in results:
        by_pairing.setdefault(result.pairing, []).append(result)
    heldout = heldout_summary(plan, by_pairing)
    summaries = {}
    for name, pairing_results in by_pairing.items():
        summaries[name] = pairing_summary(plan, name, pairing_results) | {"heldout": heldout.get(name)}
    reference_kl = summaries.get(plan.spec.reference, {}).get("kl_median")
    for summary in summaries.values():  # the health bar: the matched pairing's KL within 1.2x bf16's
        summary["kl_vs_reference"] = (summary["kl_median"] / reference_kl
                                      if summary["kl_median"] is not None and reference_kl else None)
    return results, summaries
