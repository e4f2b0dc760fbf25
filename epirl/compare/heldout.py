"""A held-out test set for the arithmetic task that no training run of the study ever sees.

The arithmetic generator draws from a small space: operands in [0, max_operand] and a few operators, 882 distinct
problems for the SmolLM2 recipe, of which one seed's 2000 draws already cover ~790. A test set of 500 problems
drawn beside the training list would therefore overlap it, so the split goes the other way round:

- the held-out set is drawn first, from the same distribution (same operands, operators, prompt text) with a
  generator seeded in its own namespace, independent of the run seeds: every pairing and seed is scored on the
  same problems, and adding seeds later does not change them;
- each run trains on its recipe's own seeded problem list (same seed, order, dedup, limit) minus the held-out
  problems, written to `compare_<name>/data/train_s<seed>.jsonl`. The run reads it as a local file whose problem
  text is the generator's prompt verbatim (`data.format=math`, `data.instruction=` empty), so the prompts the model
  sees are the arithmetic task's own.

The training stream only ever hands out problems of that list, so disjointness holds by construction;
`overlap` checks it, and tests/test_compare.py checks it over the stream itself.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from epirl.config import DataConfig, EpirlConfig
from epirl.data import ARITHMETIC_INSTRUCTION, Problem, load_problems

HELDOUT_SEED = "epirl.compare.heldout"  # a string seed: a namespace no integer run seed can reach
TRAINING_FILE_OVERRIDES = ("data.format=math", "data.instruction=", "data.limit=null")


def uses_arithmetic(cfg: EpirlConfig) -> bool:
    return cfg.data.source == "arithmetic" or cfg.data.format == "arithmetic"


def problem_key(problem: Problem) -> str:
    """What identifies a problem: the user turn's text (it holds the operands and the operator)."""
    return problem.messages[-1]["content"]


def arithmetic_space_size(data: DataConfig) -> int:
    return (data.arithmetic.max_operand + 1) ** 2 * len(set(data.arithmetic.ops))


def heldout_problems(data: DataConfig, size: int) -> list[Problem]:
    """`size` distinct problems from the arithmetic distribution of `data`, drawn as `epirl.data` draws them."""
    space = arithmetic_space_size(data)
    if size > space - 1:  # at least one problem must be left to train on
        raise ValueError(f"a held-out set of {size} problems needs more than the {space} distinct arithmetic problems "
                         f"of data.arithmetic (max_operand {data.arithmetic.max_operand}, ops "
                         f"{data.arithmetic.ops}); lower --heldout-size or raise data.arithmetic.max_operand")
    instruction = ARITHMETIC_INSTRUCTION if data.instruction is None else data.instruction
    rng = random.Random(HELDOUT_SEED)
    ops, seen, problems = list(data.arithmetic.ops), set(), []
    while len(problems) < size:
        a, b = rng.randint(0, data.arithmetic.max_operand), rng.randint(0, data.arithmetic.max_operand)
        op = rng.choice(ops)
        content = f"What is {a} {op} {b}? {instruction}".strip()  # epirl.data.arithmetic_problems' prompt
        if content in seen:
            continue
        seen.add(content)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        problems.append(Problem(f"heldout-{len(problems)}", [{"role": "user", "content": content}], str(value)))
    return problems


def training_problems(cfg: EpirlConfig, seed: int, heldout: list[Problem]) -> list[Problem]:
    """The recipe's own problem list for `seed`, in its order, without the held-out problems."""
    excluded = {problem_key(problem) for problem in heldout}
    return [problem for problem in load_problems(cfg.data, seed) if problem_key(problem) not in excluded]


def overlap(training: list[Problem], heldout: list[Problem]) -> set[str]:
    return {problem_key(p) for p in training} & {problem_key(p) for p in heldout}


def problem_rows(problems: list[Problem]) -> list[dict]:
    """Rows of a local `math`-format file (`problem`, `answer`, `id`): the prompt text exactly as generated."""
    return [{"id": p.uid, "problem": problem_key(p), "answer": p.ground_truth} for p in problems]


def rows_text(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ArithmeticSplit:
    """The study's held-out set and each seed's training list, as the file texts that hold them."""

    heldout: list[Problem]
    training_by_seed: dict[int, list[Problem]]
    data_dir: Path

    @property
    def heldout_file(self) -> Path:
        return self.data_dir / "heldout.jsonl"

    def training_file(self, seed: int) -> Path:
        return self.data_dir / f"train_s{seed}.jsonl"

    def file_texts(self) -> dict[Path, str]:
        texts = {self.heldout_file: rows_text(problem_rows(self.heldout))}
        for seed, problems in self.training_by_seed.items():
            texts[self.training_file(seed)] = rows_text(problem_rows(problems))
        return texts

    def run_overrides(self, seed: int) -> list[str]:
        """What a run of `seed` adds to its overrides (last: they replace the recipe's data source)."""
        return [f"data.source={self.training_file(seed).resolve()}", *TRAINING_FILE_OVERRIDES]

    def describe(self) -> str:
        sizes = sorted(len(problems) for problems in self.training_by_seed.values())
        span = f"{sizes[0]}" if sizes[0] == sizes[-1] else f"{sizes[0]}-{sizes[-1]}"
        return (f"{len(self.heldout)} arithmetic problems, disjoint from training; each run trains on its recipe's "
                f"seeded list without them ({span} problems)")

    def write(self) -> None:
        """Write the files whose text changed (a resumed run keeps reading an unchanged file)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for path, text in self.file_texts().items():
            if not path.is_file() or path.read_text() != text:
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(text)
                tmp.replace(path)


def build_split(cfg: EpirlConfig, seeds: tuple[int, ...], size: int, data_dir: Path) -> ArithmeticSplit:
    """The held-out set and the training lists of `seeds` for the (arithmetic) config `cfg`; raises ValueError
    when the task's problem space cannot hold them."""
    heldout = heldout_problems(cfg.data, size)
    training = {seed: training_problems(cfg, seed, heldout) for seed in seeds}
    empty = [seed for seed, problems in training.items() if not problems]
    if empty:
        raise ValueError(f"seed {empty[0]}: every training problem is in the held-out set; lower --heldout-size or "
                         "raise data.arithmetic.num_problems")
    return ArithmeticSplit(heldout, training, data_dir)
