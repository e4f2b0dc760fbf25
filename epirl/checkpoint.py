"""Resumable checkpoints: PEFT adapter, optimizer + scheduler, RNG states, data cursor and step.

With several ranks (torchrun) rank 0 writes the checkpoint (adapter and optimizer are identical on every rank)
with every rank's RNG state; `state.json` records the rank count, and a resume needs the same count.

Layout: `runs/<name>/checkpoints/step_000010/{adapter/, trainer_state.pt, state.json}`. A checkpoint is
written into a temporary folder and renamed into place, so a crash mid-write never leaves a folder that
looks complete; `state.json` is written last inside it as a second guard. Older checkpoints are deleted only
after the new one is complete.

A checkpoint can still be damaged after it was written (a full disk, a copy cut short, a hand edit): every
file is checked before a resume uses it (`checkpoint_damage`), and `latest_checkpoint` is the newest whole one.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from epirl.model import load_adapter, save_adapter
from epirl.model.adapter_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterConfigError, read_adapter_settings
from epirl.model.dummy import refuse_random_weights

STATE_FILE = "state.json"
TRAINER_STATE_FILE = "trainer_state.pt"
ADAPTER_FOLDER = "adapter"


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
                    extra: dict | None = None, keep_last: int = 2, rng_by_rank: list[dict] | None = None) -> Path:
    """`rng_by_rank`: every rank's `rng_state()` (rank order); None = this process is the only rank."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_adapter(policy, tmp / ADAPTER_FOLDER, cfg)
    rng_by_rank = rng_by_rank or [rng_state()]
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_by_rank[0],
                "rng_by_rank": rng_by_rank}, tmp / TRAINER_STATE_FILE)
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, "data": data_state, "world_size": len(rng_by_rank),
                                              **(extra or {})}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _prune(run_dir, keep_last)
    return final


def _prune(run_dir: Path, keep_last: int) -> None:
    complete = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / STATE_FILE).exists() and not p.name.endswith(".tmp"))
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def step_folders(run_dir: Path) -> list[Path]:
    """Every checkpoint folder of a run, oldest first; a `.tmp` folder is a save that never finished."""
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))


def resumable_checkpoint(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint whose files are all whole, or None; the damaged ones newer than it, newest first,
    each with why it cannot be used)."""
    damaged = []
    for folder in reversed(step_folders(run_dir)):
        reason = checkpoint_damage(folder)
        if reason is None:
            return folder, damaged
        damaged.append((folder, reason))
    return None, damaged


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint a resume can use (damaged ones are skipped; `resumable_checkpoint` names them)."""
    return resumable_checkpoint(run_dir)[0]


def read_state(path: Path) -> dict:
    """state.json of a checkpoint folder (check it with `checkpoint_damage` first)."""
    return json.loads((path / STATE_FILE).read_text())


def checkpoint_world_size(path: Path) -> int:
    """How many ranks wrote the checkpoint (1 for checkpoints from before scale-out)."""
    return int(read_state(path).get("world_size", 1))


# ------------------------------------------------------------------------------------------ integrity
def checkpoint_damage(path: Path) -> str | None:
    """Why the checkpoint folder `path` cannot be resumed from (a phrase naming the file), or None when every
    file is there and whole. The checks read headers and directories, not the tensors: they find missing,
    empty and truncated files and a state.json that is not what `save_checkpoint` writes, in milliseconds."""
    for check in (_state_damage, _trainer_state_damage, _adapter_damage):
        reason = check(path)
        if reason is not None:
            return reason
    return None


def _state_damage(path: Path) -> str | None:
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        return f"{STATE_FILE} is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return f"{STATE_FILE} is not valid JSON"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or not isinstance(state.get("data"), dict):
        return f"{STATE_FILE} lacks an integer 'step' or a 'data' mapping"
    return None


def _trainer_state_damage(path: Path) -> str | None:
    """torch.save writes a zip archive whose directory comes last: a cut-off file has none."""
    file = path / TRAINER_STATE_FILE
    if not file.is_file():
        return f"{TRAINER_STATE_FILE} is missing"
    size = file.stat().st_size
    try:
        with zipfile.ZipFile(file) as archive:
            members = archive.infolist()
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return f"{TRAINER_STATE_FILE} is truncated or not a torch.save file"
    if not any(m.filename.endswith("data.pkl") for m in members) or \
            any(m.header_offset + m.compress_size > size for m in members):
        return f"{TRAINER_STATE_FILE} is truncated or not a torch.save file"
    return None


def _adapter_damage(path: Path) -> str | None:
    folder = path / ADAPTER_FOLDER
    try:
        read_adapter_settings(folder)
    except AdapterConfigError:
        return f"{ADAPTER_FOLDER}/{ADAPTER_CONFIG} is missing or unreadable"
    reason = safetensors_damage(folder / ADAPTER_WEIGHTS)
    return f"{ADAPTER_FOLDER}/{ADAPTER_WEIGHTS} {reason}" if reason else None


def safetensors_damage(file: Path) -> str | None:
    """A .safetensors file is an 8-byte header length, a JSON header, then exactly the bytes the header's
    offsets cover: anything shorter (or longer) is damaged."""
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > size - 8:
                return "is truncated"
            header = json.loads(handle.read(header_len))
    except FileNotFoundError:
        return "is missing"
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError):
        return "is truncated or not a safetensors file"
    if not isinstance(header, dict):
        return "is not a safetensors file"
    ends = [entry["data_offsets"][1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets", ())) == 2]
    if 8 + header_len + max(ends, default=0) != size:
        return "is truncated"
    return None


def load_checkpoint(path: Path, *, policy, optimizer, scheduler, rank: int = 0) -> dict:
    """Restore adapter, optimizer, scheduler and `rank`'s RNG; returns state.json (step, data cursor, ...)."""
    if not getattr(policy, "random_weights", False):  # a random-weights run may resume its own benchmark only
        refuse_random_weights(path / ADAPTER_FOLDER, "--resume: checkpoint")
    state = read_state(path)
    load_adapter(policy, path / ADAPTER_FOLDER)
    trainer_state = torch.load(path / TRAINER_STATE_FILE, weights_only=False)
    optimizer.load_state_dict(trainer_state["optimizer"])
    scheduler.load_state_dict(trainer_state["scheduler"])
    set_rng_state(trainer_state.get("rng_by_rank", [trainer_state["rng"]])[rank])
    return state
