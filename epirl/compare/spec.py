"""What a comparison study is: the recipe, the engine/trainer pairings, the seeds and how to run them.

A pairing is a named list of `key=value` overrides (engine precision, trainer base, correction). The built-ins
cover the precision study; a YAML file given with `--pairings-file` adds more (the recipe itself cannot hold them:
the config schema refuses unknown top-level keys). Everything the study needs is one `CompareSpec`, built once
from the command line and passed down; nothing here is module-global state.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from epirl.config import ENGINE_PRECISIONS

# The precision study: does RL with an FP8 engine and an FP8 trainer learn as well as bf16?
# `w8a8` is the main recipe's default (recipes/qwen35_9b_dapo.yaml: W8A8 engine + TIS, trainer on the engine's own
# FP8 weights); `w8a8-notis` is the same without correction, to show what TIS buys; `w8a16-bitwise` the matched
# pairing with every op around the projections batch invariant too (`engine.bitwise`: KL exactly 0; bf16 models).
BUILTIN_PAIRINGS: dict[str, tuple[str, ...]] = {
    "bf16": ("engine.precision=bf16", "trainer.base=bf16", "rl.correction=tis"),
    "w8a16": ("engine.precision=w8a16", "trainer.base=fp8", "rl.correction=none"),
    "w8a16-bitwise": ("engine.precision=w8a16", "trainer.base=fp8", "rl.correction=none", "engine.bitwise=true",
                      "model.dtype=bfloat16"),
    "w8a8": ("engine.precision=w8a8", "trainer.base=shared", "rl.correction=tis"),
    "w8a8-notis": ("engine.precision=w8a8", "trainer.base=shared", "rl.correction=none"),
}
DEFAULT_PAIRINGS = ("bf16", "w8a16", "w8a8", "w8a8-notis")  # the precision study (w8a16-bitwise: ~7x the step time)
REFERENCE_PAIRING = "bf16"  # paired differences are taken against it when it is part of the study
EVAL_ENGINES = ("run", *ENGINE_PRECISIONS)  # `run`: each adapter on the engine precision it was trained with
PAIRING_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # it becomes part of folder names
# Keys the study sets per run itself; an override of them would silently break the naming or the seeds.
STUDY_KEYS = ("seed",)


class CompareInputError(ValueError):
    """Bad input to `epirl compare`: the message is the one line to show; exit code 2."""


@dataclass(frozen=True)
class Pairing:
    name: str
    overrides: tuple[str, ...]
    builtin: bool = True


@dataclass(frozen=True)
class CompareSpec:
    """One study: built by `epirl.compare_cli` from the command line, read by planning, execution and summary."""

    recipe: Path
    pairings: tuple[Pairing, ...]
    seeds: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    """The user's `key=value` overrides (applied after the pairing's, so they win), `--steps` included."""
    nproc: int = 1
    """GPUs the study uses; worker k pins its runs to the k-th visible GPU."""
    runs_per_gpu: int = 1
    """Runs side by side on each GPU (their engines' `engine.gpu_memory_utilization` shares must fit together)."""
    heldout_size: int = 500
    eval_engine: str = "run"
    resamples: int = 10_000
    """Bootstrap resamples of every interval."""
    confidence: float = 0.95
    dry_run: bool = False
    python: str = field(default_factory=lambda: sys.executable)
    """The interpreter that runs `epirl train` and the held-out evaluation (each in its own process)."""
    command_line: str = ""
    """The command as typed, recorded in summary.md / summary.json."""

    @property
    def reference(self) -> str:
        """The pairing the others are compared with on the same problems: bf16 when present, else the first."""
        names = [pairing.name for pairing in self.pairings]
        return REFERENCE_PAIRING if REFERENCE_PAIRING in names else names[0]


def parse_seeds(text: str) -> tuple[int, ...]:
    """`3` → seeds 0, 1, 2; `0,5,7` → exactly those."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items or not all(item.isdigit() for item in items):
        raise CompareInputError(f"--seeds {text}: give a count (3 = seeds 0, 1, 2) or a comma list of seeds (0,5,7)")
    if len(items) == 1:
        count = int(items[0])
        if count < 1:
            raise CompareInputError(f"--seeds {text}: at least one seed")
        return tuple(range(count))
    seeds = tuple(int(item) for item in items)
    if len(set(seeds)) != len(seeds):
        raise CompareInputError(f"--seeds {text}: a seed is listed twice")
    return seeds


def _leaf_overrides(tree: dict, prefix: str, where: str) -> list[str]:
    """A nested mapping (`engine: {precision: w8a16}`) as `key.sub=value` overrides."""
    items = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            items += _leaf_overrides(value, dotted + ".", where)
        elif isinstance(value, str) and yaml.safe_load(value or "''") == value:
            items.append(f"{dotted}={value}")
        else:  # JSON is YAML: the override parser reads back exactly this value (a string that looks like a number)
            items.append(f"{dotted}={json.dumps(value)}")
    return items


def _pairing_overrides(name: str, body, where: str) -> tuple[str, ...]:
    if isinstance(body, dict):
        items = _leaf_overrides(body, "", where)
    elif isinstance(body, list) and all(isinstance(item, str) for item in body):
        items = [item.strip() for item in body]
    else:
        raise CompareInputError(f"{where}: pairing '{name}' must be a list of key=value overrides or a mapping of "
                                "sections (engine: {precision: w8a16})")
    bad = [item for item in items if "=" not in item or not item.split("=", 1)[0].strip()]
    if bad or not items:
        shown = bad[0] if bad else ""
        raise CompareInputError(f"{where}: pairing '{name}': '{shown}' is not of the form key.sub=value")
    return tuple(items)


def read_pairings_file(path: str | Path) -> dict[str, Pairing]:
    """User pairings from a YAML mapping `name: [key=value, ...]` or `name: {section: {key: value}}`."""
    file = Path(path)
    if not file.is_file():
        raise CompareInputError(f"--pairings-file {path}: no such file")
    try:
        tree = yaml.safe_load(file.read_text())
    except yaml.YAMLError:
        raise CompareInputError(f"--pairings-file {path}: not valid YAML") from None
    if not isinstance(tree, dict) or not tree:
        raise CompareInputError(f"--pairings-file {path}: the top level must be a mapping of pairing names to "
                                "overrides")
    pairings = {}
    for name, body in tree.items():
        name = str(name)
        if not PAIRING_NAME.match(name):
            raise CompareInputError(f"--pairings-file {path}: pairing name '{name}' may only hold letters, digits, "
                                    ". _ -")
        if name in BUILTIN_PAIRINGS:
            raise CompareInputError(f"--pairings-file {path}: '{name}' is a built-in pairing; give yours another name")
        pairings[name] = Pairing(name, _pairing_overrides(name, body, f"--pairings-file {path}"), builtin=False)
    return pairings


def select_pairings(text: str, pairings_file: str | None = None) -> tuple[Pairing, ...]:
    """The pairings named by `--pairings` (comma list), from the built-ins and the pairings file."""
    known = {name: Pairing(name, overrides) for name, overrides in BUILTIN_PAIRINGS.items()}
    if pairings_file:
        known |= read_pairings_file(pairings_file)
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise CompareInputError("--pairings: name at least one pairing")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise CompareInputError(f"--pairings: unknown pairing '{unknown[0]}' (known: {', '.join(known)})")
    if len(set(names)) != len(names):
        raise CompareInputError(f"--pairings {text}: a pairing is listed twice")
    return tuple(known[name] for name in names)


def check_user_overrides(overrides: list[str], pairings: tuple[Pairing, ...]) -> None:
    """The user's overrides may not set what the study sets per run (seed) or what a pairing decides."""
    decided = {item.split("=", 1)[0].strip(): pairing.name for pairing in pairings for item in pairing.overrides}
    for item in overrides:
        if "=" not in item:
            raise CompareInputError(f"override '{item}' is not of the form key.sub=value")
        key = item.split("=", 1)[0].strip()
        if key in STUDY_KEYS:
            raise CompareInputError(f"override {item}: the study sets {key} per run; use --seeds")
        if key in decided:
            raise CompareInputError(f"override {item}: {key} is set by pairing '{decided[key]}'; "
                                    "define a pairing with --pairings-file instead")
