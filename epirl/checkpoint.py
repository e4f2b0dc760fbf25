"""Resumable checkpoints: PEFT adapter, optimizer + scheduler, RNG states, data cursor and step.

Layout: `runs/<name>/checkpoints/step_000010/{adapter/, trainer_state.pt, state.json}`. A checkpoint is
written into a temporary folder and renamed into place, so a crash mid-write never leaves a folder that
looks complete; `state.json` is written last inside it as a second guard. Older checkpoints are deleted only
after the new one is complete.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from epirl.model import load_adapter, save_adapter
from epirl.model.dummy import refuse_random_weights

STATE_FILE = "state.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, *, policy, cfg, optimizer, scheduler, data_state: dict,
                    extra: dict | None = None, keep_last: int = 2) -> Path:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_adapter(policy, tmp / "adapter", cfg)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state()},
               tmp / "trainer_state.pt")
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, "data": data_state, **(extra or {})}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _prune(run_dir, keep_last)
    return final


def _prune(run_dir: Path, keep_last: int) -> None:
    complete = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / STATE_FILE).exists() and not p.name.endswith(".tmp"))
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    complete = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / STATE_FILE).exists() and not p.name.endswith(".tmp"))
    return complete[-1] if complete else None


def load_checkpoint(path: Path, *, policy, optimizer, scheduler) -> dict:
    """Restore adapter, optimizer, scheduler and RNG; returns state.json (step, data cursor, ...)."""
    if not getattr(policy, "random_weights", False):  # a random-weights run may resume its own benchmark only
        refuse_random_weights(path / "adapter", "--resume: checkpoint")
    state = json.loads((path / STATE_FILE).read_text())
    load_adapter(policy, path / "adapter")
    trainer_state = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(trainer_state["optimizer"])
    scheduler.load_state_dict(trainer_state["scheduler"])
    set_rng_state(trainer_state["rng"])
    return state
