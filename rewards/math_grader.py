"""Answer extraction and math-verify grading: pure, in-process, no timeouts of its own.

Two answer styles:

- ``"boxed"``: the answer is the content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``) in the
  completion. math-verify would turn several boxes into a set (``\\boxed{3} ... \\boxed{5}`` parses to
  ``{3, 5}``, which matches neither 3 nor 5); a model that revises its answer writes the final one last,
  so we grade the last box only. A box that is never closed (a truncated completion) is no answer.
- ``"dapo"``: DAPO-Math's prompt asks for a last line ``Answer: $Answer``; the answer is the text after
  the LAST ``Answer:`` (case-insensitive), up to the end of that line, as in DAPO's own reward. A box
  inside that line is unwrapped (last box again).
- ``"number"``: the last number in the completion (``-3``, ``2.5``, ``3/4``), for the synthetic
  arithmetic task: small chat models answer ``12 + 13 = 25`` without any answer markup.

Gold and extracted answers are both wrapped in ``\\boxed{}`` before ``math_verify.parse``: parse returns
``[]`` for raw LaTeX without ``$`` or ``\\boxed``. ``verify(gold, pred)`` is called gold first (it is not
symmetric). math-verify's own timeouts use SIGALRM (they raise outside the main thread, and their
TimeoutException is a BaseException), so they are switched off here; untrusted completions are graded
through :class:`epirl.rewards.pool.RewardPool`, which enforces its own per-item timeout by killing the
worker. Calling :func:`grade` directly on adversarial input can therefore hang (sympy on ``9^{9^{9^9}}``).
"""

from __future__ import annotations

import logging
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

ANSWER_STYLES = ("dapo", "boxed", "number")

# math-verify logs a warning the first time its timeouts are disabled; we disable them on purpose.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BOX_COMMANDS = (r"\boxed", r"\fbox")
_DAPO_ANSWER_RE = re.compile(r"(?i)answer\s*:\s*([^\n]*)")
_LAST_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_EXTRACTION_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())


def _braced_content(text: str, open_index: int) -> str | None:
    """The content of the brace group opening at ``text[open_index] == "{"``; None if never closed."""
    depth = 0
    for index in range(open_index, len(text)):
        char = text[index]
        if char == "{" and text[index - 1] != "\\":
            depth += 1
        elif char == "}" and text[index - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : index]
    return None


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (None when absent or unclosed).

    Also accepts the brace-less ``\\boxed 5`` form (content up to whitespace or ``$``).
    """
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    after = start + len(command)
    rest = text[after:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        content = _braced_content(text, after + len(rest) - len(stripped))
    elif rest[:1].isspace():  # "\boxed 5": TeX takes the next token as the argument
        content = re.split(r"[\s$]", stripped, maxsplit=1)[0]
    else:  # e.g. "\boxedfoo": not a box command at all
        return None
    if content is None:
        return None
    content = content.strip()
    return content or None


def _strip_math_delimiters(answer: str) -> str:
    """Remove surrounding ``$...$`` / ``\\(...\\)`` / ``\\[...\\]`` and a trailing period."""
    answer = answer.strip().rstrip(".").strip()
    for opening, closing in (("$$", "$$"), ("$", "$"), (r"\(", r"\)"), (r"\[", r"\]")):
        if answer.startswith(opening) and answer.endswith(closing) and len(answer) >= len(opening) + len(closing):
            answer = answer[len(opening) : len(answer) - len(closing)].strip()
            break
    return answer.rstrip(".").strip()


def extract_answer(completion: str, style: str) -> str | None:
    """The answer string that :func:`grade` compares with the gold; None when the completion has none."""
    if style == "boxed":
        return last_boxed_content(completion)
    if style == "dapo":
        matches = _DAPO_ANSWER_RE.findall(completion)
        if not matches:
            return None
        line = matches[-1]
        boxed = last_boxed_content(line)
        answer = _strip_math_delimiters(boxed if boxed is not None else line)
        return answer or None
    if style == "number":
        numbers = _LAST_NUMBER_RE.findall(completion)
        return numbers[-1] if numbers else None
    raise ValueError(f"unknown answer style {style!r}; expected one of {ANSWER_STYLES}")


def normalize_gold(ground_truth: str) -> str:
    """Gold answers arrive as ``42``, ``$\\frac{1}{2}$`` (OlympiadBench) or ``\\boxed{...}``: unwrap to LaTeX."""
    boxed = last_boxed_content(ground_truth)
    return _strip_math_delimiters(boxed if boxed is not None else ground_truth)


def parse_boxed(latex: str) -> list:
    """math-verify parse of ``\\boxed{latex}`` with its signal-based timeout disabled."""
    return parse(f"\\boxed{{{latex}}}", extraction_config=_EXTRACTION_CONFIG, parsing_timeout=None)


def answers_match(ground_truth: str, answer: str) -> bool:
    """True when math-verify judges ``answer`` equivalent to ``ground_truth`` (gold first)."""
    gold = normalize_gold(ground_truth)
    if not gold:
        return False
    gold_parsed = parse_boxed(gold)
    answer_parsed = parse_boxed(answer)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def grade_with_answer(completion: str, ground_truth: str, style: str) -> tuple[float, str | None]:
    """(reward, extracted answer): 1.0 when the extracted answer matches the gold, else 0.0."""
    answer = extract_answer(completion, style)
    if answer is None:
        return 0.0, None
    return (1.0 if answers_match(ground_truth, answer) else 0.0), answer


def grade(completion: str, ground_truth: str, style: str) -> float:
    """1.0 if the completion's answer (``style``: "dapo", "boxed" or "number") equals the gold, else 0.0."""
    return grade_with_answer(completion, ground_truth, style)[0]
