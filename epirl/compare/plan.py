"""The study's runs: one `epirl train` run per (pairing, seed), and what each needs given what is on disk.

Layout under `<output_dir>/compare_<name>/`:
    runs/<name>_<pairing>_s<seed>/    a normal run folder (config.yaml, metrics.jsonl, adapter/, checkpoints/,
                                      train.log) plus heldout/ (the held-out evaluation's records)
    data/                             the held-out set and each seed's training list (arithmetic recipes)
    logs/                             each subprocess's console output
    summary.md, summary.json, curves.png

A repeated command continues the study: a finished run is not trained again, a run stopped by the probe is a
result (not retried), an unfinished run with a complete checkpoint resumes, anything else starts afresh with the
old folder moved aside to `<run>.old`. A run folder made with other settings is refused (one line), so one study
never mixes two setups.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from epirl.checkpoint import latest_checkpoint
from epirl.compare.heldout import ArithmeticSplit, build_split, digest, problem_rows, rows_text, uses_arithmetic
from epirl.compare.spec import CompareInputError, CompareSpec, Pairing
from epirl.config import ConfigError, EpirlConfig, load_config
from epirl.progress import read_rows

STUDY_LOCATION_KEYS = ("name", "output_dir")
PROBE_STOP_MARK = "ProbeMismatch"  # the exception name train.log's traceback carries when the probe stopped a run
HELDOUT_FOLDER = "heldout"
EVAL_META = "meta.json"


class Action(str, Enum):
    SKIP = "finished earlier"
    STOPPED = "stopped by the probe earlier"
    RESUME = "resume"
    START = "start"
    RESTART = "start afresh"


@dataclass(frozen=True)
class PlannedRun:
    pairing: Pairing
    seed: int
    name: str
    run_dir: Path
    overrides: tuple[str, ...]
    """Everything after the recipe on the `epirl train` command line."""
    config: EpirlConfig = field(repr=False)
    action: Action = Action.START

    @property
    def label(self) -> str:
        return f"{self.pairing.name} s{self.seed}"


@dataclass(frozen=True)
class StudyPlan:
    spec: CompareSpec
    study_dir: Path
    base_config: EpirlConfig = field(repr=False)
    runs: list[PlannedRun]
    split: ArithmeticSplit | None
    """None when the recipe does not train on the arithmetic task (no held-out evaluation then)."""

    @property
    def runs_dir(self) -> Path:
        return self.study_dir / "runs"

    @property
    def logs_dir(self) -> Path:
        return self.study_dir / "logs"


# ------------------------------------------------------------------------------------------------ run folders
def read_metric_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl rows (torn lines skipped, `epirl.progress.read_rows`), one per step, the last row of a step
    winning (a resumed run logs the steps after its checkpoint again)."""
    by_step = {row["step"]: row for row in read_rows(run_dir / "metrics.jsonl", up_to_step=sys.maxsize)}
    return [by_step[step] for step in sorted(by_step)]


def is_finished(run_dir: Path, steps: int) -> bool:
    """Every step logged and the final adapter written (the loop writes it after the last step)."""
    rows = read_metric_rows(run_dir)
    adapter = run_dir / "adapter"
    return (bool(rows) and rows[-1]["step"] >= steps and (adapter / "adapter_config.json").is_file()
            and (adapter / "adapter_model.safetensors").is_file())


def stopped_by_probe(run_dir: Path) -> bool:
    log = run_dir / "train.log"
    try:
        return PROBE_STOP_MARK in log.read_text(errors="replace")
    except OSError:
        return False


def settings_difference(planned: EpirlConfig, run_dir: Path) -> list[str] | None:
    """The settings in which the run folder's config.yaml differs from the planned run's (`key a ≠ b`); None when
    the folder has no readable config (a run that died before writing one)."""
    try:
        existing = load_config(run_dir / "config.yaml")
    except ConfigError:
        return None
    new, old = _flat(planned.model_dump(mode="json")), _flat(existing.model_dump(mode="json"))
    if new.get("model.dtype") == "auto":  # the run folder holds the dtype made concrete for its device
        old["model.dtype"] = "auto"
    return [f"{key} {old.get(key)!r} ≠ {new.get(key)!r}" for key in sorted(new.keys() | old.keys())
            if new.get(key) != old.get(key)]


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def decide_action(planned: EpirlConfig, run_dir: Path) -> Action:
    """What the run needs, from its folder. Raises CompareInputError when the folder holds another setup."""
    if not run_dir.exists():
        return Action.START
    difference = settings_difference(planned, run_dir)
    if difference:
        shown = "; ".join(difference[:3]) + (f"; {len(difference) - 3} more" if len(difference) > 3 else "")
        raise CompareInputError(f"{run_dir} was made with other settings ({shown}); remove it or choose another "
                                "output_dir")
    if is_finished(run_dir, planned.rl.steps):
        return Action.SKIP
    if stopped_by_probe(run_dir):
        return Action.STOPPED
    if difference is not None and latest_checkpoint(run_dir) is not None:
        return Action.RESUME
    return Action.RESTART


# ------------------------------------------------------------------------------------------------ planning
def _config(spec: CompareSpec, overrides: list[str]) -> EpirlConfig:
    try:
        return load_config(spec.recipe, overrides)
    except ConfigError as exc:
        raise CompareInputError(str(exc)) from None


def _split(spec: CompareSpec, base: EpirlConfig, study_dir: Path) -> ArithmeticSplit | None:
    if not uses_arithmetic(base):
        return None
    try:
        return build_split(base, spec.seeds, spec.heldout_size, study_dir / "data")
    except ValueError as exc:
        raise CompareInputError(f"held-out set: {exc}") from None


def plan_study(spec: CompareSpec) -> StudyPlan:
    """Every run of the study with its action; checks every input first and writes nothing.

    Raises CompareInputError (one line) for a missing recipe, a bad override or pairing, an impossible held-out
    set, or a run folder made with other settings."""
    if not spec.recipe.is_file():
        raise CompareInputError(f"recipe file not found: {spec.recipe}")
    base = _config(spec, list(spec.overrides))
    study_dir = Path(base.output_dir) / f"compare_{base.name}"
    split = _split(spec, base, study_dir)
    # `name=` and `output_dir=` of the user place the study; each run gets its own name and folder inside it
    run_overrides = [item for item in spec.overrides if item.split("=", 1)[0].strip() not in STUDY_LOCATION_KEYS]
    runs = []
    for pairing in spec.pairings:
        for seed in spec.seeds:
            name = f"{base.name}_{pairing.name}_s{seed}"
            overrides = [f"name={name}", f"seed={seed}", f"output_dir={study_dir / 'runs'}", *pairing.overrides,
                         *run_overrides, *(split.run_overrides(seed) if split else [])]
            config = _config(spec, overrides)
            run_dir = study_dir / "runs" / name
            runs.append(PlannedRun(pairing, seed, name, run_dir, tuple(overrides), config,
                                   decide_action(config, run_dir)))
    _check_split_unchanged(split, runs)
    return StudyPlan(spec, study_dir, base, runs, split)


def _check_split_unchanged(split: ArithmeticSplit | None, runs: list[PlannedRun]) -> None:
    """Runs that exist were trained on the split's files as they are on disk: a different split (another
    --heldout-size) would make their training lists overlap the new held-out set."""
    if split is None:
        return
    for path, text in split.file_texts().items():
        if path.is_file() and path.read_text() != text and any(run.run_dir.exists() for run in runs):
            raise CompareInputError(f"{path} differs from the split this command would make (another --heldout-size?); "
                                    "its runs were trained on it: use the same settings or another output_dir")


def train_command(plan: StudyPlan, run: PlannedRun) -> list[str]:
    """`epirl train RECIPE <overrides>` in its own process, `--resume RUN_DIR` for a run that continues."""
    command = [plan.spec.python, "-m", "epirl.cli", "train", str(plan.spec.recipe), *run.overrides]
    if run.action == Action.RESUME:
        command += ["--resume", str(run.run_dir)]
    return command


def eval_command(plan: StudyPlan, run: PlannedRun) -> list[str]:
    """The held-out evaluation of a finished run's adapter, in its own process (an engine per adapter)."""
    assert plan.split is not None
    return [plan.spec.python, "-m", "epirl.compare.evaluate", str(run.run_dir), "--problems",
            str(plan.split.heldout_file), "--engine", plan.spec.eval_engine, "--out", str(run.run_dir / HELDOUT_FOLDER),
            "--meta", json.dumps(eval_meta(plan))]


def eval_meta(plan: StudyPlan) -> dict:
    """What a held-out evaluation depends on besides the adapter; stored beside its records."""
    assert plan.split is not None
    return {"problems": str(plan.split.heldout_file),
            "problems_digest": digest(rows_text(problem_rows(plan.split.heldout))), "engine": plan.spec.eval_engine}


def eval_done(plan: StudyPlan, run: PlannedRun) -> bool:
    """Records exist for this held-out set and eval engine (adapters of finished runs do not change)."""
    folder = run.run_dir / HELDOUT_FOLDER
    try:
        meta = json.loads((folder / EVAL_META).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (folder / "records.jsonl").is_file() and meta == eval_meta(plan)


def heldout_verdicts(run_dir: Path) -> dict[str, bool] | None:
    """Problem id → correct from the run's held-out records (check `eval_done` first); None without records."""
    path = run_dir / HELDOUT_FOLDER / "records.jsonl"
    if not path.is_file():
        return None
    verdicts = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            verdicts[str(record["problem_id"])] = bool(record["correct"])
    return verdicts


def move_aside(run_dir: Path) -> Path:
    """An unfinished run without a complete checkpoint: kept for its log as `<run>.old` (an older one replaced)."""
    old = run_dir.with_name(run_dir.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    run_dir.rename(old)
    return old
