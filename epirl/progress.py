"""The run as the terminal shows it: a progress bar with ETA, one line per step, and a summary at the end.

`RunProgress` is the training loop's observer (`train(..., progress=RunProgress(...))`): the loop calls
`started(start_step, memory)` once the engine and trainer are up, and the observer itself once per step.
Each step line also goes to train.log; `reward.png` is redrawn after every step. On resume the earlier
steps' rows are read from metrics.jsonl, so the bar starts at the resumed step and the plot and summary
cover the whole run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from epirl.plot import sparkline, write_reward_plot

log = logging.getLogger(__name__)
GiB = 1024**3
PHASES = ("generate", "train", "probe", "publish", "release_kv", "reacquire_kv")


def finite(metrics: dict, key: str, default: float = math.nan) -> float:
    value = metrics.get(key, default)
    return float(value) if isinstance(value, (int, float)) else default


def step_line(step: int, total: int, metrics: dict) -> str:
    """`step 3/12  acc 0.375  reward +0.375  len 9  kl 1.2e-05  gen 12.1s  train 8.3s  25.0s`"""
    parts = [f"step {step}/{total}",
             f"acc {finite(metrics, 'reward/accuracy'):.3f}",
             f"reward {finite(metrics, 'reward/mean'):+.3f}",
             f"len {finite(metrics, 'response/length_mean'):.0f}"]
    if "mismatch/k3_kl" in metrics:
        parts.append(f"kl {finite(metrics, 'mismatch/k3_kl'):.1e}")
    if finite(metrics, "mismatch/bitwise_frac", 0.0) > 0.0:  # shown where engine and trainer agree bit for bit at all
        parts.append(f"bitwise {finite(metrics, 'mismatch/bitwise_frac'):.3f}")
    if finite(metrics, "train/skipped", 0.0) == 1.0:
        parts.append("no update (equal rewards)")
    parts += [f"gen {finite(metrics, 'time/generate_s', 0.0):.1f}s", f"train {finite(metrics, 'time/train_s', 0.0):.1f}s",
              f"{finite(metrics, 'time/step_s', 0.0):.1f}s"]
    return "  ".join(parts)


def read_rows(metrics_file: Path, up_to_step: int) -> list[dict]:
    """Rows of the earlier processes (steps ≤ up_to_step) of a resumed run; torn lines are skipped."""
    rows = []
    if metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= up_to_step:
                rows.append(row)
    return rows


def folder_entries(folder: Path) -> list[str]:
    """Every entry of the run folder, sorted, folders marked with a trailing `/` (what the run left on disk)."""
    if not folder.is_dir():
        return []
    return sorted(entry.name + ("/" if entry.is_dir() else "") for entry in folder.iterdir())


def _duration(seconds: float) -> str:
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{sec:02d}s" if minutes else f"{seconds:.1f}s")


class RunProgress:
    """Observer of one training process (see module docstring)."""

    def __init__(self, console: Console, run_dir: Path, total_steps: int, start_step: int = 0,
                 samples_per_prompt: int = 1, plot: bool = True):
        self.console, self.run_dir, self.total = console, run_dir, total_steps
        self.start_step, self.samples_per_prompt, self.plot = start_step, samples_per_prompt, plot
        self.rows = read_rows(run_dir / "metrics.jsonl", start_step) if start_step else []
        self.session_rows: list[dict] = []
        self.t0 = time.perf_counter()
        self.ready_s: float | None = None
        self._ready_t: float | None = None
        self._last_t: float | None = None
        self._plot_failed = False
        self.bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                            TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"),
                            console=console, transient=True, redirect_stdout=False, redirect_stderr=False)
        self.task = None
        self._bar_live = False

    # --- called by the loop ---------------------------------------------------------------------------
    def started(self, start_step: int, memory: dict) -> None:
        """Engine and trainer are up; the bar appears, at the step the run continues from."""
        self.start_step = start_step
        self._ready_t = time.perf_counter()
        self.ready_s = self._ready_t - self.t0
        held = memory.get("static_bytes")
        held_text = f", trainer holds {held / GiB:.2f} GiB" if isinstance(held, (int, float)) else ""
        resumed = f", resuming after step {start_step}" if start_step else ""
        self._say(f"ready in {_duration(self.ready_s)} (engine + trainer{held_text}){resumed}")
        if self.console.is_terminal:  # elsewhere (a file, CI) the step lines are the progress
            self.bar.start()
            self._bar_live = True
        self.task = self.bar.add_task("", total=self.total, completed=start_step)

    def __call__(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        self.rows.append(row)
        self.session_rows.append(row)
        self._last_t = time.perf_counter()
        self._say(step_line(step, self.total, metrics))
        if self.task is not None:
            self.bar.update(self.task, completed=step,
                            description=f"acc {finite(metrics, 'reward/accuracy'):.3f}")
        if self.plot and not self._plot_failed:
            try:
                write_reward_plot(self.rows, self.run_dir / "reward.png", title=self.run_dir.name)
            except Exception as exc:  # noqa: BLE001 - a plot must never stop training
                self._plot_failed = True
                log.warning("reward.png not written (%s: %s); metrics.jsonl has every step", type(exc).__name__, exc)

    # --- the CLI's ------------------------------------------------------------------------------------
    def stop(self) -> None:
        if self._bar_live:  # rich prints an empty line when stopping a bar that never showed
            self.bar.stop()
            self._bar_live = False

    def _say(self, line: str) -> None:
        log.info(line, extra={"terminal": False})  # train.log
        self.console.print(escape(line), soft_wrap=True, highlight=False)

    def summary_lines(self) -> list[str]:
        """First vs last accuracy and reward, throughput, time per phase (this process)."""
        lines = []
        if self.rows:
            first, last = self.rows[0], self.rows[-1]
            accuracy = [finite(r, "reward/accuracy") for r in self.rows]
            lines.append(f"accuracy {finite(first, 'reward/accuracy'):.3f} → {finite(last, 'reward/accuracy'):.3f} "
                         f"(step {first['step']} → {last['step']}, best {max(accuracy):.3f})  {sparkline(accuracy)}")
            lines.append(f"reward   {finite(first, 'reward/mean'):+.3f} → {finite(last, 'reward/mean'):+.3f}")
        rows = self.session_rows
        if rows:
            tokens = sum(finite(r, "response/length_mean", 0.0) * finite(r, "rollout/groups_generated", 0.0)
                         * self.samples_per_prompt for r in rows)
            gen_s = sum(finite(r, "time/generate_s", 0.0) for r in rows)
            step_s = sum(finite(r, "time/step_s", 0.0) for r in rows)
            if self._ready_t is not None and self._last_t is not None:  # wall time: eval, logging, saving too
                step_s = max(step_s, self._last_t - self._ready_t)
            if tokens and gen_s and step_s:
                lines.append(f"tokens   {tokens:,.0f} generated: {tokens / gen_s:,.0f} tok/s while generating, "
                             f"{tokens / step_s:,.0f} tok/s over the steps")
            phases = {p: sum(finite(r, f"time/{p}_s", 0.0) for r in rows) for p in PHASES}
            other = step_s - sum(phases.values())
            shown = [f"{p} {_duration(s)} ({s / step_s:.0%})" for p, s in sorted(phases.items(), key=lambda i: -i[1])
                     if step_s and s >= 0.01 * step_s]
            if step_s and other >= 0.01 * step_s:
                shown.append(f"other {_duration(other)} ({other / step_s:.0%})")
            start = f"start-up {_duration(self.ready_s)}, " if self.ready_s is not None else ""
            lines.append(f"time     {start}{len(rows)} steps {_duration(step_s)}: " + " · ".join(shown))
        return lines

    def print_summary(self, out_dir: Path) -> None:
        self.stop()
        self._say(f"done in {_duration(time.perf_counter() - self.t0)}: {out_dir} ({', '.join(folder_entries(out_dir))})")
        for line in self.summary_lines():
            self._say(line)


class PhaseProgress:
    """A command's few long phases (`epirl mismatch`: one per engine, then the trainer's scoring) as a bar with
    the phase running, and one line per finished phase (terminal and log). The bar shows only on a terminal;
    elsewhere (a file, CI) the lines are the progress. Use as a context manager around the phases."""

    def __init__(self, console: Console, label: str, total: int):
        self.console, self.total, self.done = console, total, 0
        self.bar = Progress(TextColumn(f"[bold]{escape(label)}"), MofNCompleteColumn(), BarColumn(),
                            TimeElapsedColumn(), TextColumn("{task.description}"), console=console, transient=True,
                            redirect_stdout=False, redirect_stderr=False)
        self.task = self.bar.add_task("", total=total)
        self._live = False

    def __enter__(self) -> "PhaseProgress":
        if self.console.is_terminal:
            self.bar.start()
            self._live = True
        return self

    def start(self, description: str) -> None:
        """The phase that runs now (shown beside the bar)."""
        self.bar.update(self.task, description=description)

    def finished(self, line: str) -> None:
        """One phase done: its line above the bar (and in the log), the bar one further."""
        self.done += 1
        log.info(line, extra={"terminal": False})
        self.console.print(f"[{self.done}/{self.total}] {escape(line)}", soft_wrap=True, highlight=False)
        self.bar.update(self.task, completed=self.done, description="")

    def __exit__(self, *exc) -> None:
        if self._live:  # rich prints an empty line when stopping a bar that never showed
            self.bar.stop()
            self._live = False

