"""Eval report: aggregates computed from the per-sample records, the rich table, files, W&B.

Files in the output folder: ``eval.json`` (settings, benchmark size checks, per-variant metrics,
paired comparisons) and ``records.jsonl`` (one line per variant × problem × sample).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from epirl.eval.stats import paired_comparison, summarize_correctness

POOLED = "pooled"
MAX_WANDB_FAILURES = 500  # rows of the W&B failure table (long completions make big tables)
# What each answer style (epirl.rewards ANSWER_STYLES) reads as the answer, in the words of a one-line note.
STYLE_WORDS = {"boxed": "the last \\boxed{...}", "dapo": "a last 'Answer: ...' line", "number": "the last number"}


def correctness_matrix(records: Sequence[dict], variant: str, benchmark: str | None = None) -> dict[tuple[str, str], list[bool]]:
    """``{(benchmark, problem_id): [verdict of sample 0, 1, ...]}`` in first-seen problem order."""
    by_problem: dict[tuple[str, str], dict[int, bool]] = defaultdict(dict)
    for record in records:
        if record["variant"] == variant and (benchmark is None or record["benchmark"] == benchmark):
            by_problem[(record["benchmark"], record["problem_id"])][record["sample"]] = record["correct"]
    return {key: [samples[s] for s in sorted(samples)] for key, samples in by_problem.items()}


def summarize_variant(records: Sequence[dict], variant: str, benchmark_names: Sequence[str], seed: int) -> dict[str, Any]:
    per_benchmark = {name: summarize_correctness(list(correctness_matrix(records, variant, name).values()), seed)
                     for name in benchmark_names}
    pooled = summarize_correctness(list(correctness_matrix(records, variant).values()), seed)
    for name, metrics in [*per_benchmark.items(), (None, pooled)]:  # samples whose answer could not be read
        metrics["no_answer"] = sum(1 for record in records if record["variant"] == variant
                                   and record["grade_status"] == "no_answer" and name in (None, record["benchmark"]))
    statuses = Counter(record["grade_status"] for record in records if record["variant"] == variant)
    finish = Counter(record["finish_reason"] for record in records if record["variant"] == variant)
    return {"benchmarks": per_benchmark, POOLED: pooled, "grade_status": dict(statuses), "finish_reason": dict(finish)}


def compare_variants(records: Sequence[dict], variant_a: str, variant_b: str, benchmark_names: Sequence[str]) -> dict[str, Any]:
    """Paired comparison of two variants on the same problems, using each problem's first sample
    (a binary outcome per problem is what McNemar's test needs; sample 0 is an unbiased pass@1 draw)."""

    def first_samples(benchmark: str | None) -> tuple[list[bool], list[bool]]:
        a = correctness_matrix(records, variant_a, benchmark)
        b = correctness_matrix(records, variant_b, benchmark)
        if a.keys() != b.keys():
            raise ValueError(f"{variant_a} and {variant_b} were not evaluated on the same problems")
        return [a[key][0] for key in a], [b[key][0] for key in a]

    return {
        "a": variant_a,
        "b": variant_b,
        "outcome": "first sample per problem",
        "benchmarks": {name: paired_comparison(*first_samples(name)) for name in benchmark_names},
        POOLED: paired_comparison(*first_samples(None)),
    }


def build_report(records: Sequence[dict], benchmarks: Sequence[Any], settings: Any, variants: Sequence[str], wall_s: float) -> dict[str, Any]:
    names = [benchmark.name for benchmark in benchmarks]
    return {
        "settings": dataclasses.asdict(settings),
        "wall_s": round(wall_s, 2),
        "benchmarks": {
            b.name: {"source": b.source, "evaluated": len(b.problems), "loaded_size": b.loaded_size,
                     "published_size": b.published_size, "size_matches": b.size_matches}
            for b in benchmarks
        },
        "variants": {variant: summarize_variant(records, variant, names, settings.seed) for variant in variants},
        # every later variant against the first (two adapters: the paired McNemar comparison)
        "comparisons": [compare_variants(records, variants[0], other, names) for other in variants[1:]],
    }


def write_outputs(out_dir: Path, report: dict[str, Any], records: Sequence[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    with (out_dir / "records.jsonl").open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def _percent(value: float) -> str:
    return f"{100 * value:.1f}"


def print_report(report: dict[str, Any], console: Console) -> None:
    """Accuracy table (one row per variant × benchmark, then pooled) and the paired comparisons."""
    samples = report["settings"]["samples"]
    table = Table(title=f"epirl eval (k={samples}, T={report['settings']['temperature']}, {report['wall_s']:.0f}s)")
    for column in ("variant", "benchmark", "problems", f"avg@{samples} %", "95% CI", f"pass@{samples} %", "no answer"):
        table.add_column(column, justify="left" if column in ("variant", "benchmark") else "right")
    for variant, summary in report["variants"].items():
        rows = list(summary["benchmarks"].items()) + [(POOLED, summary[POOLED])]
        for name, metrics in rows:
            size_note = "" if name == POOLED or report["benchmarks"][name]["size_matches"] else " *"
            table.add_row(variant, name + size_note, str(metrics["problems"]), _percent(metrics["accuracy"]),
                          f"[{_percent(metrics['ci95_low'])}, {_percent(metrics['ci95_high'])}]",
                          _percent(metrics[f"pass@{samples}"]), str(metrics.get("no_answer", 0)))
    console.print(table)
    if any(not info["size_matches"] for info in report["benchmarks"].values()):
        console.print("* source size differs from the published benchmark (see eval.json → benchmarks)")
    for note in report.get("notes", []):
        console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True, highlight=False)
    for comparison in report["comparisons"]:
        paired = Table(title=f"paired: {comparison['b']} − {comparison['a']} ({comparison['outcome']})")
        for column in ("benchmark", "n", "acc a %", "acc b %", "Δ pts", "95% CI", "only a", "only b", "McNemar p"):
            paired.add_column(column, justify="left" if column == "benchmark" else "right")
        for name, row in list(comparison["benchmarks"].items()) + [(POOLED, comparison[POOLED])]:
            paired.add_row(name, str(row["problems"]), _percent(row["accuracy_a"]), _percent(row["accuracy_b"]),
                           f"{100 * row['diff']:+.1f}", f"[{100 * row['diff_ci95_low']:+.1f}, {100 * row['diff_ci95_high']:+.1f}]",
                           str(row["only_a_correct"]), str(row["only_b_correct"]), f"{row['mcnemar_p']:.3g}")
        console.print(paired)


def unparseable_notes(records: Sequence[dict], training_by_variant: dict[str, Any], max_tokens: int) -> list[str]:
    """One line per (variant, benchmark) where not one generated answer could be read, saying why: a reward style
    the adapter was not trained for, completions cut at the token limit, or no answer in the graded format.

    `training_by_variant`: each variant's `TrainingTask` (its run's config) or None."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for record in records:
        if record["grade_status"] != "not_generated":
            groups[(record["variant"], record["benchmark"])].append(record)
    notes = []
    for (variant, benchmark), generated in groups.items():
        if any(record["grade_status"] != "no_answer" for record in generated):
            continue
        style = generated[0].get("grading_style", "boxed")
        training = training_by_variant.get(variant)
        if training is not None and training.reward_style != style:
            where = f" ({training.config_file})" if training.config_file else ""
            why = (f"{benchmark} is graded by {STYLE_WORDS.get(style, style)}, but {variant} was trained with "
                   f"reward.style: {training.reward_style}{where}")
            if training.is_arithmetic:
                why += "; evaluate it on its own task with --benchmarks arithmetic"
        elif all(record["finish_reason"] == "length" for record in generated):
            why = f"every completion stopped at the token limit ({max_tokens}) before an answer"
        else:
            why = f"{benchmark} is graded by {STYLE_WORDS.get(style, style)} and no completion has one (see records.jsonl)"
        notes.append(f"{variant} on {benchmark}: no answer could be read from any of {len(generated)} completion(s): {why}")
    return notes


def wandb_summary(report: dict[str, Any]) -> dict[str, float]:
    """Flat ``eval/<variant>/<benchmark>/<metric>`` numbers for a W&B run summary."""
    flat: dict[str, float] = {}
    for variant, summary in report["variants"].items():
        for name, metrics in list(summary["benchmarks"].items()) + [(POOLED, summary[POOLED])]:
            for key in ("accuracy", "ci95_low", "ci95_high"):
                flat[f"eval/{variant}/{name}/{key}"] = metrics[key]
    for comparison in report["comparisons"]:
        prefix = f"eval/paired/{comparison['b']}-vs-{comparison['a']}"
        flat[f"{prefix}/diff"] = comparison[POOLED]["diff"]
        flat[f"{prefix}/mcnemar_p"] = comparison[POOLED]["mcnemar_p"]
    return flat


def log_to_wandb(report: dict[str, Any], records: Sequence[dict], step: int | None = None) -> bool:
    """Summary + a table of failed samples into the active W&B run; False (nothing done) without one.

    `step` (in-training eval): the table goes to that training step and the run summary is left alone (the
    step's accuracies go through the tracker with the step's other metrics).

    wandb is looked up in ``sys.modules`` rather than imported: eval never starts W&B by itself, and
    importing wandb costs seconds.
    """
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:
        return False
    if step is None:
        run.summary.update(wandb_summary(report))
    columns = ["variant", "benchmark", "problem_id", "sample", "gold", "extracted_answer", "grade_status", "finish_reason", "completion"]
    failures = [record for record in records if not record["correct"]][:MAX_WANDB_FAILURES]
    table = wandb.Table(columns=columns, data=[[record[c] for c in columns] for record in failures])
    run.log({"eval/failures": table}, **({} if step is None else {"step": step}))
    return True
