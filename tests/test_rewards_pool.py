"""RewardPool: order, counted outcomes, our own timeout on a sympy-hanging input, crash recovery."""

import os
import time

import pytest

from epirl.rewards import RewardPool, grade

# sympy tries to evaluate this power tower exactly when comparing it with the gold: it never returns.
SYMPY_HANG = r"The answer is \boxed{9^{9^{9^{9}}}}"
TIMEOUT_S = 1.5


def exit_on_crash_marker(completion, ground_truth, style):
    """Score function that kills its worker process (like a segfault) on a marker completion."""
    if completion == "CRASH":
        os._exit(3)
    if completion == "RAISE":
        raise RecursionError("deep sympy recursion")
    return 1.0, completion


@pytest.fixture(scope="module")
def pool():
    with RewardPool(workers=2, timeout_s=TIMEOUT_S) as shared_pool:
        yield shared_pool


def test_batch_matches_in_process_grading(pool):
    completions = [r"\boxed{\frac{1}{2}}", r"\boxed{3}", "no answer", r"x \boxed{1} y \boxed{2}", r"\boxed{5\%}"]
    golds = ["0.5", "4", "1", "2", "0.05"]
    rewards, stats = pool.grade_batch(completions, golds, "boxed")
    assert rewards == [grade(c, g, "boxed") for c, g in zip(completions, golds)]
    assert rewards == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert stats == {"reward/graded": 4.0, "reward/no_answer": 1.0, "reward/timeouts": 0.0, "reward/crashes": 0.0}


def test_order_is_preserved_on_a_larger_batch(pool):
    completions = [rf"\boxed{{{i}}}" for i in range(40)]
    golds = [str(i if i % 3 else i + 1) for i in range(40)]
    rewards, _ = pool.grade_batch(completions, golds, "boxed")
    assert rewards == [0.0 if i % 3 == 0 else 1.0 for i in range(40)]


def test_hanging_input_times_out_is_counted_and_pool_recovers(pool):
    replacements_before = pool.replacements
    started = time.monotonic()
    results = pool.grade_batch_detailed([SYMPY_HANG, r"\boxed{2}", SYMPY_HANG, r"\boxed{7}"], ["5", "2", "5", "7"], "boxed")
    elapsed = time.monotonic() - started
    assert [r.status for r in results] == ["timeout", "graded", "timeout", "graded"]
    assert [r.reward for r in results] == [0.0, 1.0, 0.0, 1.0]
    assert all(r.seconds >= TIMEOUT_S for r in results if r.status == "timeout")
    # two workers: both hangs run side by side, so the batch takes about one timeout, not two or forever
    assert elapsed < 2 * TIMEOUT_S + 1.5
    assert pool.replacements == replacements_before + 2
    rewards, stats = pool.grade_batch([r"\boxed{1}"] * 4, ["1"] * 4, "boxed")
    assert rewards == [1.0] * 4 and stats["reward/timeouts"] == 0.0


def test_timeouts_are_counted_in_stats(pool):
    _, stats = pool.grade_batch([SYMPY_HANG, r"\boxed{2}"], ["5", "2"], "boxed")
    assert stats == {"reward/graded": 1.0, "reward/no_answer": 0.0, "reward/timeouts": 1.0, "reward/crashes": 0.0}


def test_worker_death_and_exceptions_are_crashes_and_pool_keeps_working():
    with RewardPool(workers=2, timeout_s=5.0, score_fn=exit_on_crash_marker) as crash_pool:
        rewards, stats = crash_pool.grade_batch(["a", "CRASH", "b", "RAISE", "c"], ["x"] * 5, "boxed")
        assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert stats["reward/crashes"] == 2.0 and stats["reward/graded"] == 3.0
        assert crash_pool.replacements == 1  # the killed worker only; an exception keeps its worker
        rewards, stats = crash_pool.grade_batch(["d"] * 3, ["x"] * 3, "boxed")
        assert rewards == [1.0] * 3 and stats["reward/crashes"] == 0.0


def test_bad_arguments_fail_clearly(pool):
    with pytest.raises(ValueError, match="2 completions but 1"):
        pool.grade_batch(["a", "b"], ["1"], "boxed")
    with pytest.raises(ValueError, match="answer style"):
        pool.grade_batch(["a"], ["1"], "latex")
    with pytest.raises(ValueError, match="workers"):
        RewardPool(workers=0)


def test_closed_pool_refuses_work_and_close_is_idempotent():
    closed = RewardPool(workers=1, timeout_s=1.0)
    closed.close()
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.grade_batch([r"\boxed{1}"], ["1"], "boxed")


def test_empty_batch(pool):
    assert pool.grade_batch([], [], "dapo") == ([], {"reward/graded": 0.0, "reward/no_answer": 0.0, "reward/timeouts": 0.0, "reward/crashes": 0.0})
