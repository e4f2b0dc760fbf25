"""Benchmark loaders: OlympiadBench (OE_TO_maths_en_COMP), Minerva math, MATH-500.

Each loads from its Hugging Face id or from a local .jsonl/.parquet file with the same columns, and
becomes a list of :class:`EvalProblem` (id, problem text, gold answers, benchmark name). The published
sizes are checked on load: a different count is logged as a warning (a partial or different file would
otherwise silently change what "accuracy on MATH-500" means) and recorded in the report.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from epirl.data import DataError, read_records

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
    to_problem: Callable[[dict[str, Any], int], EvalProblem]


@dataclass(frozen=True)
class Benchmark:
    """A loaded benchmark: where it came from, its problems (after ``limit``), and the size check."""

    name: str
    source: str
    problems: list[EvalProblem]
    loaded_size: int  # rows in the source, before --limit
    published_size: int

    @property
    def size_matches(self) -> bool:
        return self.loaded_size == self.published_size


def _strip_dollars(answer: str) -> str:
    answer = answer.strip()
    while len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer[1:-1].strip()
    return answer


def _olympiadbench_problem(row: dict[str, Any], index: int) -> EvalProblem:
    answers = row["final_answer"]
    if isinstance(answers, str):
        answers = [answers]
    if not answers:
        raise KeyError("final_answer (empty)")
    return EvalProblem(str(row.get("id", index)), str(row["question"]), tuple(str(a) for a in answers), "olympiadbench")


def _minerva_problem(row: dict[str, Any], index: int) -> EvalProblem:
    return EvalProblem(str(row.get("id", index)), str(row["question"]), (str(row["answer"]),), "minerva")


def _math500_problem(row: dict[str, Any], index: int) -> EvalProblem:
    return EvalProblem(str(row.get("unique_id", index)), str(row["problem"]), (str(row["answer"]),), "math500")


BENCHMARKS: dict[str, BenchmarkSpec] = {
    spec.name: spec
    for spec in (
        BenchmarkSpec("olympiadbench", "Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train", 674,
                      ("question", "final_answer"), _olympiadbench_problem),
        BenchmarkSpec("minerva", "math-ai/minervamath", None, "test", 272, ("question", "answer"), _minerva_problem),
        BenchmarkSpec("math500", "HuggingFaceH4/MATH-500", None, "test", 500, ("problem", "answer"), _math500_problem),
    )
}


def parse_benchmark_list(text: str) -> list[tuple[str, str | None]]:
    """``"olympiadbench,minerva=data/minerva.jsonl"`` → ``[("olympiadbench", None), ("minerva", "data/...")]``."""
    entries = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, path = item.partition("=")
        name = name.strip().lower()
        if name not in BENCHMARKS:
            raise DataError(f"unknown benchmark '{name}' (known: {', '.join(BENCHMARKS)})")
        if _ and not path.strip():
            raise DataError(f"benchmark '{name}=' needs a file path after '='")
        entries.append((name, path.strip() or None))
    if not entries:
        raise DataError("no benchmarks given")
    return entries


def load_benchmark(name: str, source: str | None = None, limit: int | None = None) -> Benchmark:
    """Load benchmark ``name`` from ``source`` (a local file) or, when None, its hub id.

    Raises :class:`epirl.data.DataError` (one line naming the file or column) on a bad source.
    """
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
            problems.append(spec.to_problem(row, index))
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
