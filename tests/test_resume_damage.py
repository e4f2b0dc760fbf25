"""`epirl train --resume` with damaged checkpoints, and what an interrupted run says is on disk.

Checkpoint files are written here directly (no model, no engine): every file of a checkpoint is checked before
a resume uses it; a damaged newest one is named in one warning line and the previous whole one is used; none
whole is one error line and exit 2. The run itself (`_run`, `train`) is replaced, so each case takes seconds.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cli_helpers import run_cli
from epirl import train_cli
from epirl.checkpoint import STATE_FILE, checkpoint_damage, latest_checkpoint, resumable_checkpoint
from epirl.config import dump_config, load_config
from epirl.model.adapter_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_adapter_config

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_arith_cpu.yaml"


def write_checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint folder whose files are what save_checkpoint writes, shaped but tiny."""
    folder = run_dir / "checkpoints" / f"step_{step:06d}"
    (folder / "adapter").mkdir(parents=True)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 8)},
              str(folder / "adapter" / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / "adapter" / ADAPTER_CONFIG).write_text(json.dumps(peft_adapter_config(4, 8.0, ["q_proj"])))
    torch.save({"optimizer": {"state": {}, "param_groups": []}, "scheduler": {}, "rng": {}, "rng_by_rank": [{}]},
               folder / "trainer_state.pt")
    (folder / STATE_FILE).write_text(json.dumps({"step": step, "data": {"cursor": 8 * step}, "world_size": 1}))
    return folder


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


DAMAGE = {
    "state.json not JSON": (lambda c: (c / STATE_FILE).write_text('{"step": 8, "da'), "state.json is not valid JSON"),
    "state.json missing": (lambda c: (c / STATE_FILE).unlink(), "state.json is missing"),
    "state.json without step": (lambda c: (c / STATE_FILE).write_text('{"data": {}}'), "lacks an integer 'step'"),
    "trainer state truncated": (lambda c: truncate(c / "trainer_state.pt"), "trainer_state.pt is truncated"),
    "trainer state missing": (lambda c: (c / "trainer_state.pt").unlink(), "trainer_state.pt is missing"),
    "adapter tensors truncated": (lambda c: truncate(c / "adapter" / ADAPTER_WEIGHTS, 0.9),
                                  "adapter/adapter_model.safetensors is truncated"),
    "adapter tensors missing": (lambda c: (c / "adapter" / ADAPTER_WEIGHTS).unlink(),
                                "adapter/adapter_model.safetensors is missing"),
    "adapter config missing": (lambda c: (c / "adapter" / ADAPTER_CONFIG).unlink(),
                               "adapter/adapter_config.json is missing or unreadable"),
}


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """runs/arith with its config.yaml and whole checkpoints at steps 4 and 8; the command runs in tmp_path."""
    monkeypatch.chdir(tmp_path)
    run = Path("runs") / "arith"
    dump_config(load_config(RECIPE, ["output_dir=runs", "name=arith"]), run / "config.yaml")
    write_checkpoint(run, 4)
    write_checkpoint(run, 8)
    return run


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_checkpoint_file_is_checked(run_dir, damage):
    spoil, reason = DAMAGE[damage]
    newest = run_dir / "checkpoints" / "step_000008"
    assert checkpoint_damage(newest) is None
    spoil(newest)
    assert reason in checkpoint_damage(newest)
    found, damaged = resumable_checkpoint(run_dir)
    assert found.name == "step_000004" and [(p.name, reason in why) for p, why in damaged] == [("step_000008", True)]
    assert latest_checkpoint(run_dir).name == "step_000004"  # what the training loop restores


def test_a_damaged_newest_checkpoint_is_named_once_and_the_previous_one_is_used(run_dir, monkeypatch, capfd):
    (run_dir / "checkpoints" / "step_000008" / STATE_FILE).write_text("{not json")
    started = {}

    def fake_run(cfg, run, start_step, out, created, resume, benchmark=None, rank=0):
        started.update(run=run, start_step=start_step, resume=resume)
        return 0

    monkeypatch.setattr(train_cli, "_run", fake_run)
    code, lines = run_cli(["train", "--resume", str(run_dir)], capfd)
    assert code == 0
    assert lines == ["warning: --resume runs/arith: checkpoint step_000008 (state.json is not valid JSON) is damaged; "
                     "continuing from step_000004 (step 4)"]
    assert started == {"run": run_dir, "start_step": 4, "resume": True}
    assert "step_000008 (state.json is not valid JSON) is damaged" in (run_dir / "train.log").read_text()


def test_no_whole_checkpoint_is_one_line_and_exit_2(run_dir, capfd):
    (run_dir / "checkpoints" / "step_000008" / STATE_FILE).write_text("{not json")
    truncate(run_dir / "checkpoints" / "step_000004" / "trainer_state.pt")
    before = sorted(p.name for p in run_dir.iterdir())
    code, lines = run_cli(["train", "--resume", str(run_dir)], capfd)
    assert code == 2
    assert lines == ["error: --resume runs/arith: no complete checkpoint under runs/arith/checkpoints; damaged: "
                     "step_000008 (state.json is not valid JSON), step_000004 (trainer_state.pt is truncated or not "
                     "a torch.save file)"]
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing written into the run


def _interrupt_training(monkeypatch):
    """The run starts and is interrupted in its first step (no engine: inputs and training are replaced)."""
    monkeypatch.setattr(train_cli, "_check_and_plan", lambda *args, **kwargs: [])

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("epirl.rl.loop.train", interrupted)  # train_cli imports it when the run starts


def test_interrupt_without_a_checkpoint_does_not_offer_a_resume(run_dir, monkeypatch, capfd):
    for folder in (run_dir / "checkpoints").iterdir():  # the folder exists (an earlier run) but holds no checkpoint
        for path in sorted(folder.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        folder.rmdir()
    _interrupt_training(monkeypatch)
    code, lines = run_cli(["train", str(RECIPE), "output_dir=runs", "name=arith"], capfd)
    assert code == 130
    assert lines == ["interrupted: no complete checkpoint under runs/arith/checkpoints, so there is nothing to resume; "
                     "log in runs/arith/train.log"]


def test_interrupt_names_the_checkpoint_a_resume_continues_from(run_dir, monkeypatch, capfd):
    (run_dir / "checkpoints" / "step_000008" / "trainer_state.pt").unlink()
    _interrupt_training(monkeypatch)
    code, lines = run_cli(["train", "--resume", str(run_dir)], capfd)
    assert code == 130
    assert lines[-1] == ("interrupted: the last complete checkpoint is step_000004 (step 4); "
                         "continue with --resume runs/arith")


def test_interrupt_of_a_new_run_before_step_1_keeps_only_its_log(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    _interrupt_training(monkeypatch)
    code, lines = run_cli(["train", str(RECIPE), "output_dir=runs", "name=fresh"], capfd)
    assert code == 130
    assert lines == ["interrupted: before step 1; nothing to resume; log in runs/fresh.failed/train.log"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["fresh.failed"]
