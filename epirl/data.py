"""Prompt sources: a Hugging Face dataset id, a local jsonl/parquet file, or a seeded arithmetic task.

Every source becomes a list of `Problem`s (chat messages + ground truth); `PromptStream` turns them into
token ids with the tokenizer's chat template and hands them out in a seeded order with a resumable cursor.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from typing import Any, Iterable

from epirl import hub
from epirl.config import DataConfig, first_line

log = logging.getLogger(__name__)

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
ARITHMETIC_INSTRUCTION = "Answer with just the number."


class DataError(ValueError):
    """The data source is missing or has the wrong schema; the message names the file or column."""


@dataclass(frozen=True)
class Problem:
    """One prompt: chat messages (without the assistant turn) and the answer to grade against."""

    uid: str
    messages: list[dict[str, str]]
    ground_truth: str


@dataclass
class Prompt:
    problem: Problem
    token_ids: list[int] = field(repr=False)
    position: int = 0
    """Index of this draw in the stream (across epochs): a name for the draw that no rank count changes."""


# ----------------------------------------------------------------------------------------------- readers
def read_records(source: str, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a local .jsonl/.json/.parquet file, or of a hub dataset (`org/name` or `org/name:config`).

    What is a path and what is a hub id: `epirl.hub` (a path-like source that does not exist is a missing
    file, never a hub lookup)."""
    path = hub.local_path(source)
    if path is not None:
        if not path.exists():
            raise DataError(f"data.source: no such file: {source}")
        if not path.is_file():
            raise DataError(f"data.source: {source} is a folder; give a .jsonl, .json or .parquet file")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        rows = []
        with path.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        raise DataError(f"{path}:{lineno}: not a JSON object") from None
        return rows
    hub.require_hub("data.source", source, DataError)
    import datasets

    name, _, config = source.partition(":")
    try:
        dataset = datasets.load_dataset(name, config or None, split=split)
    except Exception as exc:  # hub unreachable, unknown id, bad split: one line naming the source
        reason = first_line(exc, "")
        raise DataError(f"data.source: cannot load hub dataset '{source}' (split {split}): "
                        f"{type(exc).__name__}: {reason}") from None
    return dataset.to_list()


def detect_format(row: dict[str, Any]) -> str:
    if "prompt" in row and "reward_model" in row:
        return "dapo"
    if ("problem" in row or "question" in row) and "answer" in row:
        return "math"
    raise DataError(f"cannot detect the data format from columns {sorted(row)}; set data.format")


def _dapo_problem(row: dict[str, Any], index: int) -> Problem:
    messages = row["prompt"]
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    truth = row["reward_model"]["ground_truth"]
    uid = str((row.get("extra_info") or {}).get("index", index))
    return Problem(uid=uid, messages=[dict(m) for m in messages], ground_truth=str(truth))


def _math_problem(row: dict[str, Any], index: int, instruction: str) -> Problem:
    text = row.get("problem", row.get("question"))
    uid = str(row.get("unique_id", row.get("id", index)))
    content = f"{text}\n\n{instruction}" if instruction else str(text)
    return Problem(uid=uid, messages=[{"role": "user", "content": content}], ground_truth=str(row["answer"]))


def arithmetic_problems(num: int, max_operand: int, ops: Iterable[str], seed: int, instruction: str) -> list[Problem]:
    """Seeded synthetic arithmetic ("What is 7 + 12?"): a task a 135M model can learn on a CPU."""
    rng = random.Random(seed)
    ops = list(ops)
    problems = []
    for i in range(num):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        content = f"What is {a} {op} {b}? {instruction}".strip()
        problems.append(Problem(uid=f"arith-{i}", messages=[{"role": "user", "content": content}], ground_truth=str(value)))
    return problems


def load_problems(cfg: DataConfig, seed: int) -> list[Problem]:
    """All problems of the configured source, deduplicated and limited, in file order."""
    if cfg.source == "arithmetic" or cfg.format == "arithmetic":
        instruction = ARITHMETIC_INSTRUCTION if cfg.instruction is None else cfg.instruction
        a = cfg.arithmetic
        problems = arithmetic_problems(a.num_problems, a.max_operand, a.ops, seed, instruction)
    else:
        rows = read_records(cfg.source, cfg.split)
        if not rows:
            raise DataError(f"data source '{cfg.source}' has no rows")
        fmt = detect_format(rows[0]) if cfg.format == "auto" else cfg.format
        problems = []
        for i, row in enumerate(rows):
            try:
                if fmt == "dapo":
                    problems.append(_dapo_problem(row, i))
                else:
                    problems.append(_math_problem(row, i, BOXED_INSTRUCTION if cfg.instruction is None else cfg.instruction))
            except (KeyError, TypeError) as exc:
                raise DataError(f"{cfg.source}: row {i} lacks field {exc} for format '{fmt}'") from None
    if cfg.system_prompt:
        problems = [Problem(p.uid, [{"role": "system", "content": cfg.system_prompt}] + p.messages, p.ground_truth) for p in problems]
    if cfg.dedup:
        problems = deduplicate(problems)
    if cfg.limit:
        problems = problems[: cfg.limit]
    return problems


def deduplicate(problems: list[Problem]) -> list[Problem]:
    """Keep the first occurrence of each (messages, answer); DAPO-Math-17k repeats prompts ~100x."""
    seen, kept = set(), []
    for p in problems:
        key = (json.dumps(p.messages, sort_keys=True), p.ground_truth)
        if key not in seen:
            seen.add(key)
            kept.append(p)
    if len(kept) < len(problems):
        log.info("dedup: %d of %d prompts are unique", len(kept), len(problems))
    return kept


# -------------------------------------------------------------------------------------- tokenization
def render_prompt(tokenizer, messages: list[dict[str, str]], thinking: bool) -> list[int]:
    """Token ids of the chat template with the generation prompt; `enable_thinking` for Qwen3/3.5."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, enable_thinking=thinking
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers ≥5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class PromptStream:
    """Seeded, epoch-based order over the problems with a cursor that checkpoints can save and restore."""

    def __init__(self, problems: list[Problem], tokenizer, *, seed: int, shuffle: bool, thinking: bool,
                 max_prompt_tokens: int):
        if not problems:
            raise DataError("no problems to train on")
        self.problems, self.tokenizer = problems, tokenizer
        self.seed, self.shuffle, self.thinking = seed, shuffle, thinking
        self.max_prompt_tokens = max_prompt_tokens
        self.cursor = 0  # prompts handed out so far, across epochs
        self.skipped_too_long = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _next_problem(self) -> Problem:
        epoch, offset = divmod(self.cursor, len(self.problems))
        self.cursor += 1
        return self.problems[self._order(epoch)[offset]]

    def take(self, count: int) -> list[Prompt]:
        # Consecutive too-long prompts: any 2N positions in a row hold one whole (shuffled) epoch, so 2N
        # misses mean no prompt fits (N misses can straddle two epochs and skip the one that does).
        prompts, misses = [], 0
        while len(prompts) < count:
            if misses >= 2 * len(self.problems):
                raise DataError(f"every prompt is longer than {self.max_prompt_tokens} tokens (data.max_prompt_tokens, "
                                "at most model.max_model_len - rl.max_tokens)")
            position = self.cursor
            problem = self._next_problem()
            ids = render_prompt(self.tokenizer, problem.messages, self.thinking)
            if len(ids) > self.max_prompt_tokens:
                self.skipped_too_long += 1
                misses += 1
                continue
            misses = 0
            prompts.append(Prompt(problem, ids, position))
        return prompts

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor, "skipped_too_long": self.skipped_too_long}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.cursor = int(state["cursor"])
        self.skipped_too_long = int(state.get("skipped_too_long", 0))
