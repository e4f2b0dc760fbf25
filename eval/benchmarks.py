"""Benchmark loaders: OlympiadBench (OE_TO_maths_en_COMP), Minerva math, MATH-500, and the arithmetic task.

Each math benchmark loads from its Hugging Face id or from a local .jsonl/.parquet file with the same columns
(`local_file_columns`), and becomes a list of :class:`EvalProblem` (id, problem text, gold answers, benchmark
name). The published sizes are checked on load: a different count is logged as a warning (a partial or
different file would otherwise silently change what "accuracy on MATH-500" means) and recorded in the report.
They ask for the answer in ``\\boxed{}`` and grade the last box.

`arithmetic` is the synthetic training task itself (epirl.data): the problems, instruction and seed of the
run that trained the adapter when its config.yaml is known (`TrainingTask`), and graded the way that run's
rewards were (`reward.style`), so an adapter is measured on what it learned.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from epirl.config import DataConfig, EpirlConfig
from epirl.data import BOXED_INSTRUCTION, DataError, load_problems, read_records

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalProblem:
    """One benchmark problem. ``answers`` are the gold parts (OlympiadBench lists several for
    multiple-answer problems); they are graded as one joined gold, see :attr:`gold`."""

    id: str
    problem: str
    answers: tuple[str, ...]
    benchmark: str

    @property
    def gold(self) -> str:
        # math-verify parses "1, 2" as the set {1, 2}: a multiple-answer problem needs all parts.
        return ", ".join(_strip_dollars(answer) for answer in self.answers)


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    hub_id: str
    hub_config: str | None
    split: str
    published_size: int
    required_columns: tuple[str, ...]
    id_column: str
    """Optional column with the problem's id (the row index otherwise)."""
    to_problem: Callable[[dict[str, Any], str], EvalProblem]


@dataclass(frozen=True)
class Benchmark:
    """A loaded benchmark: where it came from, its problems (after ``limit``), and the size check."""

    name: str
    source: str
    problems: list[EvalProblem]
    loaded_size: int  # rows in the source, before --limit
    published_size: int
    instruction: str = BOXED_INSTRUCTION
    """Appended to each problem in the prompt ("" when the problem text carries its own)."""
    grading_style: str = "boxed"
    """How answers are read (epirl.rewards ANSWER_STYLES) unless the variant's training says otherwise."""
    training_task: bool = False
    """The training task's own data: an adapter trained on it is graded with its training `reward.style`."""
    system_prompt: str | None = None
    """A system message before each problem (the training run's `data.system_prompt`)."""

    @property
    def size_matches(self) -> bool:
        return self.loaded_size == self.published_size


def _strip_dollars(answer: str) -> str:
    answer = answer.strip()
    while len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer[1:-1].strip()
    return answer


def _olympiadbench_problem(row: dict[str, Any], problem_id: str) -> EvalProblem:
    answers = row["final_answer"]
    if isinstance(answers, str):
        answers = [answers]
    if not answers:
        raise KeyError("final_answer (empty)")
    return EvalProblem(problem_id, str(row["question"]), tuple(str(a) for a in answers), "olympiadbench")


def _minerva_problem(row: dict[str, Any], problem_id: str) -> EvalProblem:
    return EvalProblem(problem_id, str(row["question"]), (str(row["answer"]),), "minerva")


def _math500_problem(row: dict[str, Any], problem_id: str) -> EvalProblem:
    return EvalProblem(problem_id, str(row["problem"]), (str(row["answer"]),), "math500")


BENCHMARKS: dict[str, BenchmarkSpec] = {
    spec.name: spec
    for spec in (
        BenchmarkSpec("olympiadbench", "Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train", 674,
                      ("question", "final_answer"), "id", _olympiadbench_problem),
        BenchmarkSpec("minerva", "math-ai/minervamath", None, "test", 272, ("question", "answer"), "id",
                      _minerva_problem),
        BenchmarkSpec("math500", "HuggingFaceH4/MATH-500", None, "test", 500, ("problem", "answer"), "unique_id",
                      _math500_problem),
    )
}
TRAINING_TASK = "arithmetic"  # generated, never a file: the synthetic training task (epirl.data)
BENCHMARK_NAMES = (*BENCHMARKS, TRAINING_TASK)


def local_file_columns() -> list[str]:
    """The columns a local benchmark file needs, one line per benchmark (for --help)."""
    return [f"{spec.name}: {', '.join(spec.required_columns)} (optional: {spec.id_column}, the problem's id)"
            for spec in BENCHMARKS.values()]


@dataclass(frozen=True)
class TrainingTask:
    """What an adapter was trained on, from its run's config.yaml: the arithmetic benchmark is built from it and
    graded with its reward style. Without a config: the arithmetic task's defaults, graded by its last number."""

    data: DataConfig
    seed: int = 0
    reward_style: str = "number"
    config_file: str | None = None

    @classmethod
    def from_config(cls, cfg: EpirlConfig, config_file: str | None = None) -> "TrainingTask":
        return cls(cfg.data, cfg.seed, cfg.reward.style, config_file)

    @property
    def is_arithmetic(self) -> bool:
        return self.data.source == TRAINING_TASK or self.data.format == TRAINING_TASK


def training_task_benchmark(task: TrainingTask | None, limit: int | None = None) -> Benchmark:
    """The arithmetic task as a benchmark: the training run's problems and prompts when `task` trained on it."""
    if task is None or not task.is_arithmetic:
        task = TrainingTask(DataConfig())
    # The training run's own list (its seed, dedup, data.limit); each problem text is the training prompt,
    # instruction included, so nothing is appended to it.
    task_problems = load_problems(task.data, task.seed)
    problems = [EvalProblem(p.uid, p.messages[-1]["content"], (p.ground_truth,), TRAINING_TASK) for p in task_problems]
    source = task.config_file or "epirl.data arithmetic defaults"
    return Benchmark(TRAINING_TASK, source, problems[:limit] if limit else problems, len(problems), len(problems),
                     instruction="", grading_style=task.reward_style, training_task=True,
                     system_prompt=task.data.system_prompt)


def parse_benchmark_list(text: str) -> list[tuple[str, str | None]]:
    """``"olympiadbench,minerva=data/minerva.jsonl"`` → ``[("olympiadbench", None), ("minerva", "data/...")]``."""
    entries = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, path = item.partition("=")
        name = name.strip().lower()
        if name not in BENCHMARK_NAMES:
            raise DataError(f"unknown benchmark '{name}' (known: {', '.join(BENCHMARK_NAMES)})")
        if name == TRAINING_TASK and _:
            raise DataError(f"benchmark '{TRAINING_TASK}' is generated (the training task) and takes no file")
        if _ and not path.strip():
            raise DataError(f"benchmark '{name}=' needs a file path after '='")
        entries.append((name, path.strip() or None))
    if not entries:
        raise DataError("no benchmarks given")
    return entries


def load_benchmark(name: str, source: str | None = None, limit: int | None = None,
                   training: TrainingTask | None = None) -> Benchmark:
    """Load benchmark ``name`` from ``source`` (a local file) or, when None, its hub id; `arithmetic` is
    generated from `training` (see :func:`training_task_benchmark`).

    Raises :class:`epirl.data.DataError` (one line naming the file or column) on a bad source.
    """
    if name == TRAINING_TASK:
        return training_task_benchmark(training, limit)
    spec = BENCHMARKS[name]
    if source is not None and not Path(source).is_file():
        raise DataError(f"{name}: benchmark file not found: {source}")
    origin = source if source is not None else spec.hub_id + (f":{spec.hub_config}" if spec.hub_config else "")
    rows = read_records(origin, spec.split)
    if not rows:
        raise DataError(f"{name}: {origin} has no rows")
    missing = [column for column in spec.required_columns if column not in rows[0]]
    if missing:
        raise DataError(f"{name}: {origin} lacks column(s) {', '.join(missing)} (has {', '.join(sorted(rows[0]))})")
    problems = []
    for index, row in enumerate(rows):
        try:
            problems.append(spec.to_problem(row, str(row.get(spec.id_column, index))))
        except (KeyError, TypeError) as error:
            raise DataError(f"{name}: {origin} row {index} lacks field {error}") from None
    _check_unique_ids(name, origin, problems)
    if len(rows) != spec.published_size:
        log.warning("%s: %s has %d problems, the published benchmark has %d", name, origin, len(rows), spec.published_size)
    if limit is not None:
        problems = problems[:limit]
    return Benchmark(name, origin, problems, len(rows), spec.published_size)


def _check_unique_ids(name: str, origin: str, problems: list[EvalProblem]) -> None:
    # Paired comparisons match problems by id; a duplicate would pair the wrong problems.
    seen: set[str] = set()
    for problem in problems:
        if problem.id in seen:
            raise DataError(f"{name}: {origin} has duplicate problem id '{problem.id}'")
        seen.add(problem.id)
