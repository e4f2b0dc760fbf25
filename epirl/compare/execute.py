"""Running the study: each run's training and held-out evaluation in their own processes, up to N side by side.

`--nproc N` starts N workers; worker k owns the k-th visible GPU (CUDA_VISIBLE_DEVICES of its processes) and
takes the next run whenever its previous one is done, so two runs never share a GPU even when they take
different times. `--runs-per-gpu K` gives each GPU K workers (a small model leaves most of an H100 idle): their
engines' shares of the GPU must fit beside each other (`check_gpu_sharing`). On a machine without GPUs the workers are
processes side by side.

Processes are started through a `launcher` (one `Launch` in, exit code out): `ProcessLauncher` runs the command
with its output in `logs/`; tests pass a fake one so that no engine starts.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from epirl.compare.plan import (Action, PlannedRun, StudyPlan, eval_command, eval_done, heldout_verdicts, is_finished,
                                read_metric_rows, stopped_by_probe, train_command)
from epirl.console import log_tail


@dataclass(frozen=True)
class Launch:
    kind: str
    """`train` or `eval`."""
    run: PlannedRun
    command: list[str]
    env: dict[str, str]
    log_file: Path


Launcher = Callable[[Launch], int]


class Terminated(KeyboardInterrupt):
    """SIGTERM (e.g. `timeout` ending a device call): the study stops and takes its running processes with it."""


class ProcessLauncher:
    """Runs each command with stdout and stderr appended to its log file; returns its exit code. Keeps the live
    processes so that a terminated study can end them: orphaned runs would hold their GPU after the study is gone."""

    def __init__(self):
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def __call__(self, launch: Launch) -> int:
        launch.log_file.parent.mkdir(parents=True, exist_ok=True)
        with launch.log_file.open("a") as log:
            process = subprocess.Popen(launch.command, env=launch.env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
            with self._lock:
                self._live.add(process)
            try:
                return process.wait()
            finally:
                with self._lock:
                    self._live.discard(process)

    def terminate(self) -> None:
        """SIGTERM to every running process (a run's checkpoints are written atomically: it resumes later)."""
        with self._lock:
            for process in self._live:
                process.terminate()


@dataclass(frozen=True)
class RunOutcome:
    run: PlannedRun
    state: str
    """`finished`, `stopped` (by the probe) or `failed`."""
    train_rc: int | None = None
    """None when the run was not trained by this command."""
    eval_rc: int | None = None
    seconds: float = 0.0
    gpu: str = ""
    error: str = ""


def gpu_ids(nproc: int) -> list[str]:
    """The GPUs the workers own: CUDA_VISIBLE_DEVICES' entries when set, else every device torch sees; on a machine
    without GPUs plain numbers (harmless there). Raises ValueError when fewer GPUs than workers are visible."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [item.strip() for item in visible.split(",") if item.strip()]
    else:
        import torch

        ids = [str(index) for index in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if not ids:
        return [str(index) for index in range(nproc)]
    if len(ids) < nproc:
        raise ValueError(f"--nproc {nproc}: only {len(ids)} GPU(s) visible ({','.join(ids)})")
    return ids[:nproc]


GPU_SHARE_LIMIT = 0.9  # of one GPU, for the engines of the runs beside each other (the trainers take some too)


def worker_gpus(nproc: int, runs_per_gpu: int = 1) -> list[str]:
    """The GPU of each worker: `runs_per_gpu` workers on each of `gpu_ids(nproc)`, the GPUs taken in turn (so that
    fewer pending runs than workers still spread over the GPUs)."""
    return [gpu for _ in range(runs_per_gpu) for gpu in gpu_ids(nproc)]


def check_gpu_sharing(plan: StudyPlan, runs_per_gpu: int) -> None:
    """Runs beside each other on one GPU: their engines' memory shares must add up to at most GPU_SHARE_LIMIT, and each
    engine needs a fixed KV cache (vLLM sizes a free one by profiling the GPU's free memory, which a neighbour that
    frees memory at that moment makes it refuse). Raises ValueError naming the field."""
    if runs_per_gpu == 1:
        return
    share = max(run.config.engine.gpu_memory_utilization for run in plan.runs)
    if runs_per_gpu * share > GPU_SHARE_LIMIT:
        raise ValueError(f"--runs-per-gpu {runs_per_gpu}: {runs_per_gpu} engines × engine.gpu_memory_utilization "
                         f"{share:g} is more than {GPU_SHARE_LIMIT:g} of a GPU; set engine.gpu_memory_utilization="
                         f"{math.floor(GPU_SHARE_LIMIT / runs_per_gpu * 100) / 100:g} or lower")
    if any(not run.config.engine.vllm_args.get("kv_cache_memory_bytes") for run in plan.runs):
        raise ValueError(f"--runs-per-gpu {runs_per_gpu}: runs sharing a GPU need a fixed KV cache; set "
                         "engine.vllm_args.kv_cache_memory_bytes (e.g. 2147483648 for 2 GiB)")


def needs_work(plan: StudyPlan, run: PlannedRun) -> bool:
    if run.action in (Action.START, Action.RESTART, Action.RESUME):
        return True
    return run.action == Action.SKIP and plan.split is not None and not eval_done(plan, run)


class StudyExecutor:
    """Runs the plan's pending runs over `nproc` workers; calls `on_done(outcome, finished_count, total)` under a
    lock after each run (progress lines come out whole and in completion order)."""

    def __init__(self, plan: StudyPlan, launcher: Launcher,
                 on_done: Callable[[RunOutcome, int, int], None] | None = None):
        self.plan, self.launcher, self.on_done = plan, launcher, on_done
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.outcomes: list[RunOutcome] = []

    def log_file(self, run: PlannedRun, kind: str) -> Path:
        return self.plan.logs_dir / f"{run.name}.{kind}.log"

    def _launch(self, kind: str, run: PlannedRun, command: list[str], gpu: str) -> int:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
        return self.launcher(Launch(kind, run, command, env, self.log_file(run, kind)))

    def run_one(self, run: PlannedRun, gpu: str) -> RunOutcome:
        """Train (start or resume) when needed, then evaluate a finished run's adapter when needed."""
        started = time.perf_counter()
        train_rc = eval_rc = None
        if run.action in (Action.START, Action.RESTART, Action.RESUME):
            train_rc = self._launch("train", run, train_command(self.plan, run), gpu)
        finished = is_finished(run.run_dir, run.config.rl.steps)
        if finished and self.plan.split is not None and not eval_done(self.plan, run):
            eval_rc = self._launch("eval", run, eval_command(self.plan, run), gpu)
        state = "finished" if finished else ("stopped" if stopped_by_probe(run.run_dir) else "failed")
        return RunOutcome(run, state, train_rc, eval_rc, time.perf_counter() - started, gpu)

    def _worker(self, queue: deque, gpu: str, total: int) -> None:
        while not self._stop.is_set():
            with self._lock:
                if not queue:
                    return
                run = queue.popleft()
            try:
                outcome = self.run_one(run, gpu)
            except Exception as exc:  # noqa: BLE001 - one run's failure is its line; the others go on
                outcome = RunOutcome(run, "failed", gpu=gpu, error=f"{type(exc).__name__}: {exc}")
            with self._lock:
                self.outcomes.append(outcome)
                if self.on_done is not None:
                    try:
                        self.on_done(outcome, len(self.outcomes), total)
                    except Exception as exc:  # noqa: BLE001 - a report that fails must not stop the runs
                        print(f"warning: progress report failed: {type(exc).__name__}: {exc}", file=sys.stderr)

    def run(self, nproc: int, runs_per_gpu: int = 1) -> list[RunOutcome]:
        """Every pending run, over `runs_per_gpu` workers on each of `nproc` GPUs. On Ctrl-C (which reaches the child
        processes too) no further run is started; on SIGTERM (`Terminated`) the running processes are ended as well."""
        pending = [run for run in self.plan.runs if needs_work(self.plan, run)]
        if not pending:
            return []
        queue = deque(pending)
        workers = [threading.Thread(target=self._worker, args=(queue, gpu, len(pending)), daemon=True)
                   for gpu in worker_gpus(nproc, runs_per_gpu)[: len(pending)]]
        for worker in workers:
            worker.start()
        try:
            # A signal that interrupts Thread.join can leave the thread marked as ended while it still runs (CPython
            # 3.11), so the main thread waits in sleep, where the SIGTERM / Ctrl-C exception is raised harmlessly.
            while any(worker.is_alive() for worker in workers):
                time.sleep(0.2)
        except KeyboardInterrupt as interrupt:
            self._stop.set()
            if isinstance(interrupt, Terminated) and hasattr(self.launcher, "terminate"):
                self.launcher.terminate()
            for worker in workers:
                worker.join()
            raise
        return self.outcomes


# ------------------------------------------------------------------------------------------------ progress lines
def _finite(values: list) -> list[float]:
    return [float(value) for value in values if isinstance(value, (int, float)) and math.isfinite(value)]


def _duration(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{seconds:.0f}s"


def _heldout_accuracy(run: PlannedRun) -> str | None:
    verdicts = heldout_verdicts(run.run_dir)
    if not verdicts:
        return None
    return f"held-out {sum(verdicts.values()) / len(verdicts):.3f} ({len(verdicts)} problems)"


def outcome_line(outcome: RunOutcome, executor: StudyExecutor) -> str:
    """`bf16 s1: trained 40/40 steps, held-out 0.712 (500 problems), reward +0.81 (last 5 steps), KL 1.2e-05, 6m12s`"""
    run, steps = outcome.run, outcome.run.config.rl.steps
    rows = read_metric_rows(run.run_dir)
    done = rows[-1]["step"] if rows else 0
    parts = []
    if outcome.error:
        parts.append(f"failed: {outcome.error}")
    elif outcome.state == "stopped":
        parts.append(f"stopped by the probe after step {done} of {steps} (log: {run.run_dir / 'train.log'})")
    elif outcome.state == "failed":
        tail = log_tail(executor.log_file(run, "train"), 1)
        parts.append(f"failed (exit {outcome.train_rc}) after {done} of {steps} steps: {tail[0] if tail else ''} "
                     f"(log: {executor.log_file(run, 'train')})")
    else:
        verb = {Action.RESUME: "resumed, trained", Action.SKIP: "trained earlier"}.get(run.action, "trained")
        parts.append(f"{verb} {done}/{steps} steps")
        if outcome.eval_rc not in (None, 0):
            parts.append(f"held-out evaluation failed (exit {outcome.eval_rc}; log: {executor.log_file(run, 'eval')})")
        accuracy = _heldout_accuracy(run)
        if accuracy is not None and outcome.eval_rc in (None, 0):
            parts.append(accuracy)
    if rows:
        rewards = _finite([row.get("reward/mean") for row in rows[-5:]])
        kl = _finite([row.get("mismatch/k3_kl") for row in rows])
        if rewards:
            parts.append(f"reward {statistics.fmean(rewards):+.3f} (last {len(rows[-5:])} steps)")
        if kl:
            parts.append(f"median KL {statistics.median(kl):.1e}")
    parts.append(_duration(outcome.seconds))
    return f"{run.label}: " + ", ".join(parts)
