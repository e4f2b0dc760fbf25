"""A persistent grading process pool with our own per-item timeout.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot cancel a running task, so one completion
that sends sympy into a ``9^{9^{9^9}}`` evaluation would hold a worker (and the batch) forever, and a
worker that dies breaks the whole executor. Here every worker has its own pipe and runs one item at a
time; the parent waits on all pipes with the nearest deadline, SIGKILLs a worker whose item overruns
``timeout_s`` (reward 0.0, counted as a timeout), and starts a replacement in the background. A worker
that dies mid-item (segfault, OOM kill) gives reward 0.0, counted as a crash; so does a Python exception
raised by the grading function. Nothing is silent: every item ends in exactly one of the counted states.

Workers start with "forkserver" by default: the fork server imports math-verify/sympy once, so a
replacement worker is ready in tens of milliseconds, and no worker inherits the threads of a parent that
runs torch/vLLM (plain "fork" would). The deadline of an item starts when it is sent to a ready worker,
so worker start-up never eats into an item's time.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Callable

from epirl.rewards.math_grader import ANSWER_STYLES, grade_with_answer

logger = logging.getLogger(__name__)

# (completion, ground_truth, style) -> (reward, extracted answer); must be picklable by reference.
ScoreFn = Callable[[str, str, str], "tuple[float, str | None]"]

STATUSES = ("graded", "no_answer", "timeout", "crash")
_GRADER_MODULE = "epirl.rewards.math_grader"


@dataclass(frozen=True)
class GradeResult:
    """Outcome of grading one completion. ``status`` is one of :data:`STATUSES`."""

    reward: float
    answer: str | None
    status: str
    seconds: float


def _worker_main(conn: Connection, score_fn: ScoreFn) -> None:
    """Worker loop: receive ``(index, completion, ground_truth, style)``, send back the outcome."""
    # Ctrl-C goes to the whole process group; the parent handles it and kills us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:  # warm sympy/latex2sympy caches so an item's deadline never pays for first use
        score_fn("\\boxed{1}", "1", "boxed")
    except BaseException:
        pass  # a score_fn that fails here will fail (and be counted) on real items too
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        index, completion, ground_truth, style = message
        started = time.perf_counter()
        try:
            reward, answer = score_fn(completion, ground_truth, style)
            conn.send(("ok", index, float(reward), answer, time.perf_counter() - started))
        except BaseException as error:  # math-verify's TimeoutException is a BaseException
            conn.send(("error", index, f"{type(error).__name__}: {error}"[:300], time.perf_counter() - started))


class _Worker:
    """One worker process, its pipe, and the item it is grading (if any)."""

    def __init__(self, context, score_fn: ScoreFn):
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(target=_worker_main, args=(child_conn, score_fn), daemon=True)
        self.process.start()
        child_conn.close()  # so the parent sees EOF when the child dies
        self.started_at = time.monotonic()
        self.ready = False
        self.item: int | None = None
        self.deadline = float("inf")
        self.sent_at = 0.0

    def send(self, index: int, payload: tuple, timeout_s: float) -> None:
        self.conn.send((index, *payload))
        self.item = index
        self.sent_at = time.monotonic()
        self.deadline = self.sent_at + timeout_s

    def release(self) -> None:
        self.item = None
        self.deadline = float("inf")

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()


class RewardPool:
    """Grade completions in ``workers`` processes; each item gets at most ``timeout_s`` seconds.

    Use as a context manager (or call :meth:`close`); keep one pool for the whole run, since starting
    workers costs about a second (a replacement after a timeout, forked from the fork server, is quick).
    One batch at a time: ``grade_batch`` is not meant to be called from two threads at once.
    Processes that create a pool need the usual ``if __name__ == "__main__":`` guard (forkserver/spawn).
    """

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 5.0,
        start_method: str = "forkserver",
        score_fn: ScoreFn = grade_with_answer,
        startup_timeout_s: float = 120.0,
    ):
        if workers < 1:
            raise ValueError(f"RewardPool needs workers >= 1, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"RewardPool needs timeout_s > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = startup_timeout_s
        self._score_fn = score_fn
        self._context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Only takes effect if the fork server is not running yet; harmless otherwise.
            self._context.set_forkserver_preload([_GRADER_MODULE])
        self._workers = [_Worker(self._context, score_fn) for _ in range(workers)]
        self.replacements = 0  # workers killed or dead and started again, over the pool's life
        self._closed = False

    # -- public API ----------------------------------------------------------------------------------

    def grade_batch(
        self, completions: list[str], ground_truths: list[str], style: str
    ) -> tuple[list[float], dict[str, float]]:
        """Rewards in input order, and counts ``reward/{graded,no_answer,timeouts,crashes}``."""
        results = self.grade_batch_detailed(completions, ground_truths, style)
        return [result.reward for result in results], batch_stats(results)

    def grade_batch_detailed(self, completions: list[str], ground_truths: list[str], style: str) -> list[GradeResult]:
        """One :class:`GradeResult` per completion, in input order."""
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if len(completions) != len(ground_truths):
            raise ValueError(f"{len(completions)} completions but {len(ground_truths)} ground truths")
        if style not in ANSWER_STYLES:
            raise ValueError(f"unknown answer style {style!r}; expected one of {ANSWER_STYLES}")
        results: list[GradeResult | None] = [None] * len(completions)
        pending = deque(range(len(completions)))
        while pending or any(worker.item is not None for worker in self._workers):
            for worker in self._workers:
                if worker.ready and worker.item is None and pending:
                    index = pending.popleft()
                    worker.send(index, (completions[index], ground_truths[index], style), self.timeout_s)
            self._wait_and_collect(results)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=1.0)
            worker.kill()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    # -- internals -----------------------------------------------------------------------------------

    def _wait_and_collect(self, results: list[GradeResult | None]) -> None:
        """Block until a message arrives or the nearest deadline passes; record outcomes."""
        now = time.monotonic()
        nearest = min(worker.deadline for worker in self._workers)
        wait_s = max(0.0, nearest - now) if nearest != float("inf") else 1.0
        for conn in wait([worker.conn for worker in self._workers], timeout=wait_s):
            worker = next(w for w in self._workers if w.conn is conn)
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._on_worker_death(worker, results)
                continue
            self._on_message(worker, message, results)
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
            if worker.item is not None and now >= worker.deadline:
                results[worker.item] = GradeResult(0.0, None, "timeout", now - worker.sent_at)
                logger.warning("reward: item %d timed out after %.1fs; killing its worker", worker.item, self.timeout_s)
                self._replace(slot)
            elif not worker.ready and now - worker.started_at > self.startup_timeout_s:
                raise RuntimeError(f"reward worker did not start within {self.startup_timeout_s:.0f}s")

    def _on_message(self, worker: _Worker, message: tuple, results: list[GradeResult | None]) -> None:
        kind = message[0]
        if kind == "ready":
            worker.ready = True
            return
        index = message[1]
        if index != worker.item:  # a late reply for an item already timed out cannot happen: we kill first
            raise RuntimeError(f"reward worker replied for item {index}, expected {worker.item}")
        if kind == "ok":
            _, _, reward, answer, seconds = message
            status = "graded" if answer is not None else "no_answer"
            results[index] = GradeResult(reward, answer, status, seconds)
        else:
            _, _, error, seconds = message
            logger.warning("reward: grading item %d raised %s", index, error)
            results[index] = GradeResult(0.0, None, "crash", seconds)
        worker.release()

    def _on_worker_death(self, worker: _Worker, results: list[GradeResult | None]) -> None:
        slot = self._workers.index(worker)
        if worker.item is None:
            # Died while idle or starting: not an item's fault, but a pool that cannot start is broken.
            if not worker.ready:
                raise RuntimeError(f"reward worker died during start-up (exit code {worker.process.exitcode})")
        else:
            seconds = time.monotonic() - worker.sent_at
            worker.process.join(timeout=5.0)
            logger.warning("reward: worker died grading item %d (exit code %s)", worker.item, worker.process.exitcode)
            results[worker.item] = GradeResult(0.0, None, "crash", seconds)
        self._replace(slot)

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = _Worker(self._context, self._score_fn)
        self.replacements += 1


def batch_stats(results: list[GradeResult]) -> dict[str, float]:
    """Counts per outcome under the metric names the RL loop logs."""
    counts = {status: 0 for status in STATUSES}
    for result in results:
        counts[result.status] += 1
    return {
        "reward/graded": float(counts["graded"]),
        "reward/no_answer": float(counts["no_answer"]),
        "reward/timeouts": float(counts["timeout"]),
        "reward/crashes": float(counts["crash"]),
    }
