"""Metrics: always to `runs/<name>/metrics.jsonl`, to Weights & Biases when enabled, and a rich console line.

W&B mode `auto` is online with WANDB_API_KEY set and offline otherwise (offline runs sync later with
`wandb sync`). A W&B failure never kills training: it is reported once and tracking continues locally.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from epirl.config import EpirlConfig

log = logging.getLogger(__name__)


def wandb_mode(setting: str) -> str:
    if setting != "auto":
        return setting
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _row_step(line: str) -> float:
    """The step of a JSONL row; a blank or torn row (the crash that made this a resume) sorts last: dropped."""
    try:
        return float(json.loads(line)["step"]) if line.strip() else float("inf")
    except (ValueError, KeyError, TypeError):
        return float("inf")


class Tracker:
    """Writes one JSON object per step (append-only, flushed) and mirrors it to W&B."""

    def __init__(self, cfg: EpirlConfig, run_dir: Path, resume: bool = False):
        self.cfg = cfg
        self.path = run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", buffering=1)
        self._wandb = None
        mode = wandb_mode(cfg.tracking.wandb)
        if mode != "disabled":
            self._wandb = self._init_wandb(mode, run_dir, resume)

    def _init_wandb(self, mode: str, run_dir: Path, resume: bool):
        try:
            import wandb

            run_id_file = run_dir / "wandb_id"
            # Our own id (wandb.util.generate_id is gone in recent wandb); kept so a resumed run continues the
            # same W&B run (resume="allow"). wandb writes one folder per process under run_dir/wandb/ (offline:
            # offline-run-<time>-<id>); `wandb sync` uploads them in start-time order into that one run.
            run_id = run_id_file.read_text().strip() if resume and run_id_file.exists() else uuid.uuid4().hex[:12]
            run_id_file.write_text(run_id)
            return wandb.init(project=self.cfg.tracking.project, name=self.cfg.name, id=run_id, mode=mode,
                              dir=str(run_dir), config=self.cfg.model_dump(mode="json"),
                              resume="allow" if resume else None, reinit="finish_previous",
                              # train.log already holds the console; W&B's own copy of it would be a second one
                              settings=wandb.Settings(console="off"))
        except Exception as exc:  # network, auth, disk: training goes on with local metrics
            log.warning("W&B disabled for this run (%s: %s); metrics still go to %s", type(exc).__name__, exc, self.path)
            return None

    def forget_after(self, step: int) -> None:
        """On resume: drop rows of steps after the checkpoint (they are about to be re-run and re-logged).

        Rewritten through a temporary file and a rename, so a crash here loses nothing already written."""
        self._fh.close()
        for path in (self.path, self.path.parent / "samples.jsonl"):
            if not path.exists():
                continue
            kept = [line for line in path.read_text().splitlines(keepends=True) if _row_step(line) <= step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
        self._fh = self.path.open("a", buffering=1)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self._fh.write(json.dumps(record, default=float) + "\n")
        if self._wandb is not None:
            try:
                self._wandb.log(metrics, step=step)
            except Exception as exc:
                log.warning("W&B log failed (%s); continuing with local metrics only", exc)
                self._wandb = None

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A table of sample completions (prompt, completion, reward) — to W&B and `samples.jsonl`."""
        with (self.path.parent / "samples.jsonl").open("a") as fh:
            for row in rows:
                fh.write(json.dumps({"step": step, **row}) + "\n")
        if self._wandb is not None and rows:
            import wandb

            columns = list(rows[0])
            table = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
            self._wandb.log({"samples": table}, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        if self._wandb is not None:
            self._wandb.summary.update(values)

    def close(self) -> None:
        self._fh.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def memory_metrics() -> dict[str, float]:
    """Host peak RSS and, on CUDA, allocated/peak/reserved GPU memory (GiB)."""
    gib = 1024**3
    out = {"mem/cpu_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}
    if torch.cuda.is_available():
        out |= {
            "mem/gpu_allocated_gib": torch.cuda.memory_allocated() / gib,
            "mem/gpu_peak_gib": torch.cuda.max_memory_allocated() / gib,
            "mem/gpu_reserved_gib": torch.cuda.memory_reserved() / gib,
        }
    return out


class PhaseTimer:
    """`with timer("generate"): ...` accumulates wall time per phase into `time/<phase>_s`."""

    def __init__(self):
        self.times: dict[str, float] = {}

    def __call__(self, phase: str):
        timer = self

        class _Phase:
            def __enter__(self):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                key = f"time/{phase}_s"
                timer.times[key] = timer.times.get(key, 0.0) + time.perf_counter() - self.start

        return _Phase()

    def pop(self) -> dict[str, float]:
        times, self.times = self.times, {}
        return times
