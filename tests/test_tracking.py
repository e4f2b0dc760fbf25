"""Metrics always reach metrics.jsonl; W&B offline gets the config, metrics and the samples table."""

import json
import re

from epirl.config import load_config
from epirl.tracking import PhaseTimer, Tracker, wandb_mode


def test_wandb_mode_auto(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"
    assert wandb_mode("disabled") == "disabled"


def test_tracker_writes_jsonl_and_an_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["tracking.wandb=offline", "name=t"])
    tracker = Tracker(cfg, tmp_path)
    assert tracker._wandb is not None, "an offline W&B run must start without network or key"
    tracker.log(1, {"reward/mean": 0.5})
    tracker.log_samples(1, [{"prompt": "p", "completion": "c", "ground_truth": "1", "reward": 1.0}])
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["reward/mean"] == 0.5
    assert json.loads((tmp_path / "samples.jsonl").read_text())["completion"] == "c"
    assert list((tmp_path / "wandb").glob("offline-run-*")), "offline run folder (for `wandb sync`)"
    assert (tmp_path / "wandb_id").read_text()


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    """Same id (runs/<name>/wandb_id), resume="allow", the same runs/<name>/wandb/ folder: wandb keeps one
    session folder per process, and `wandb sync` uploads the sessions of one id into that one run."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["tracking.wandb=offline", "name=t"])
    first = Tracker(cfg, tmp_path)
    first.log(1, {"reward/mean": 0.5})
    run_id = first._wandb.id
    first.close()
    resumed = Tracker(cfg, tmp_path, resume=True)
    assert resumed._wandb.id == run_id and resumed._wandb.settings.resume == "allow"
    resumed.log(2, {"reward/mean": 0.6})
    resumed.close()
    sessions = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # wandb names a session folder offline-run-<date>_<time>-<id>, plus "-1" when two sessions start in one second
    assert sessions and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", p.name) for p in sessions)
    assert (tmp_path / "wandb_id").read_text() == run_id


def test_phase_timer_accumulates():
    timer = PhaseTimer()
    for _ in range(2):
        with timer("train"):
            pass
    times = timer.pop()
    assert set(times) == {"time/train_s"} and times["time/train_s"] >= 0.0
    assert timer.pop() == {}


def test_resume_forgets_the_rows_of_steps_that_run_again(tmp_path):
    """A crash after step 4 with the last checkpoint at step 2: steps 3-4 run again and are logged once."""
    cfg = load_config(None, ["tracking.wandb=disabled", "name=t"])
    first = Tracker(cfg, tmp_path)
    for step in range(1, 5):
        first.log(step, {"reward/mean": step / 10})
        first.log_samples(step, [{"prompt": "p", "completion": str(step), "ground_truth": "1", "reward": 0.0}])
    first.close()
    again = Tracker(cfg, tmp_path, resume=True)
    again.forget_after(2)
    again.log(3, {"reward/mean": 0.3})
    again.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and samples == [1, 2]
