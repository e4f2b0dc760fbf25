"""The whole study: plan (every input checked, nothing written) → runs → held-out evaluations → summary.

Exit codes: 0 when every run has an outcome (finished and evaluated, or stopped by the probe, which the table
reports), 1 when a run or an evaluation failed (repeat the command to continue), 2 for bad input (one line,
nothing written), 130 / 143 when interrupted / terminated (the runs are ended; repeat the command to continue).
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

from rich.console import Console
from rich.markup import escape

from epirl.compare.collect import collect_study
from epirl.compare.execute import (Launcher, ProcessLauncher, RunOutcome, StudyExecutor, Terminated, check_gpu_sharing,
                                   gpu_ids, needs_work, outcome_line)
from epirl.compare.plan import Action, StudyPlan, eval_done, is_finished, move_aside, plan_study, stopped_by_probe
from epirl.compare.report import write_summary
from epirl.compare.spec import CompareInputError, CompareSpec
from epirl.console import error_line


def _say(console: Console, label: str, text: str) -> None:
    console.print(f"[bold]{label:<8}[/] {escape(text)}", soft_wrap=True, highlight=False)


def _main_thread() -> bool:
    """Signal handlers can only be installed from the main thread."""
    return threading.current_thread() is threading.main_thread()


def describe_plan(plan: StudyPlan, console: Console) -> None:
    spec = plan.spec
    counts: dict[str, int] = {}
    for run in plan.runs:
        counts[run.action.value] = counts.get(run.action.value, 0) + 1
    pairings = ", ".join(pairing.name for pairing in spec.pairings)
    steps = plan.runs[0].config.rl.steps
    _say(console, "compare", f"{plan.base_config.name}: {len(spec.pairings)} pairing(s) ({pairings}) × "
                             f"{len(spec.seeds)} seed(s) = {len(plan.runs)} runs of {steps} steps in {plan.study_dir}")
    sharing = f" ({spec.runs_per_gpu} per GPU)" if spec.runs_per_gpu > 1 else " (one GPU each)" if spec.nproc > 1 else ""
    _say(console, "runs", ", ".join(f"{count} {action}" for action, count in counts.items())
         + f"; {spec.nproc * spec.runs_per_gpu} side by side{sharing}")
    if plan.split is None:
        _say(console, "held-out", "none: the recipe does not train on data.source: arithmetic")
    else:
        engine = "each run's own engine" if spec.eval_engine == "run" else f"{spec.eval_engine} engine"
        _say(console, "held-out", f"{plan.split.describe()}; scored greedily on {engine}")


def prepare_folders(plan: StudyPlan, console: Console) -> None:
    """The study folder, the split's files, and unfinished runs without a checkpoint moved aside (one line each)."""
    plan.runs_dir.mkdir(parents=True, exist_ok=True)
    plan.logs_dir.mkdir(parents=True, exist_ok=True)
    if plan.split is not None:
        plan.split.write()
    for run in plan.runs:
        if run.action == Action.RESTART:
            old = move_aside(run.run_dir)
            _say(console, "restart", f"{run.label}: unfinished, no complete checkpoint; moved to {old}, "
                                     "starting afresh")


def study_complete(plan: StudyPlan) -> bool:
    """Every run finished (and evaluated, where there is a held-out set) or stopped by the probe."""
    for run in plan.runs:
        if is_finished(run.run_dir, run.config.rl.steps):
            if plan.split is not None and not eval_done(plan, run):
                return False
        elif not stopped_by_probe(run.run_dir):
            return False
    return True


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def run_study(spec: CompareSpec, console: Console | None = None, launcher: Launcher | None = None,
              on_run_done: Callable[[RunOutcome], None] | None = None) -> int:
    """Entry point behind `epirl compare`; returns the exit code. `on_run_done(outcome)`: after each run's line
    (the command's progress bar)."""
    console = console or Console(stderr=True)
    launcher = launcher or ProcessLauncher()
    try:
        plan = plan_study(spec)
        if any(needs_work(plan, run) for run in plan.runs):
            gpu_ids(spec.nproc)  # fewer GPUs than --nproc: refused before anything starts
            check_gpu_sharing(plan, spec.runs_per_gpu)
    except (CompareInputError, ValueError) as exc:
        error_line(console, str(exc))
        return 2
    describe_plan(plan, console)
    if spec.dry_run:
        console.print("[green]dry run:[/] the study is valid; nothing was run or written", highlight=False)
        return 0
    prepare_folders(plan, console)

    executor = StudyExecutor(plan, launcher)

    def progress(outcome, count: int, total: int) -> None:
        console.print(f"[{count}/{total}] {escape(outcome_line(outcome, executor))}", soft_wrap=True, highlight=False)
        if on_run_done is not None:
            on_run_done(outcome)
        write_summary(plan, *collect_study(plan))  # after every run: a study cut short still has its table so far

    executor.on_done = progress
    handles_sigterm = _main_thread()
    previous_handler = signal.signal(signal.SIGTERM, _raise_terminated) if handles_sigterm else None
    try:
        executor.run(spec.nproc, spec.runs_per_gpu)
    except KeyboardInterrupt as interrupt:  # each run left a resumable folder (or one that is moved aside next time)
        console.print(f"[yellow]{'terminated' if isinstance(interrupt, Terminated) else 'interrupted'}[/]: repeat the "
                      f"command to continue the study in {escape(str(plan.study_dir))} (finished runs are kept, "
                      "unfinished ones resume from their last checkpoint)", soft_wrap=True, highlight=False)
        return 143 if isinstance(interrupt, Terminated) else 130
    finally:
        if handles_sigterm:
            signal.signal(signal.SIGTERM, previous_handler if previous_handler is not None else signal.SIG_DFL)
    results, summaries = collect_study(plan)
    table = write_summary(plan, results, summaries)
    print(table, flush=True)
    _say(console, "wrote", f"{plan.study_dir / 'summary.md'}, summary.json, curves.png")
    if not study_complete(plan):
        console.print("[yellow]incomplete:[/] some runs or evaluations failed (lines above); repeat the command to "
                      "continue them", soft_wrap=True, highlight=False)
        return 1
    return 0
