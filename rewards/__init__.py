"""Rewards: math-verify grading (in-process or in a timeout-enforcing process pool), DAPO overlong shaping.

``grade`` is pure and in-process; untrusted completions go through ``RewardPool``, which enforces its own
per-item timeout (math-verify's signal-based one is off). See ``math_grader`` for the answer policies.
"""

from epirl.rewards.math_grader import (
    ANSWER_STYLES,
    answers_match,
    extract_answer,
    grade,
    grade_with_answer,
    last_boxed_content,
    normalize_gold,
)
from epirl.rewards.pool import STATUSES, GradeResult, RewardPool, batch_stats
from epirl.rewards.shaping import overlong_penalty

__all__ = [
    "ANSWER_STYLES",
    "STATUSES",
    "GradeResult",
    "RewardPool",
    "answers_match",
    "batch_stats",
    "extract_answer",
    "grade",
    "grade_with_answer",
    "last_boxed_content",
    "normalize_gold",
    "overlong_penalty",
]
