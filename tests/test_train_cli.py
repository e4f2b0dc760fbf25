"""What a user sees from `epirl train`: one-line errors (once, exit 2, nothing left behind), --print-config,
--help-config with the recipe's values, --dry-run, a failing engine's log tail, and the thread plan."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from epirl.config import load_config

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_arith_cpu.yaml"


def epirl_train(tmp_path, *args, env=None, timeout=600):
    """`epirl train RECIPE args` in a subprocess with its output folder under tmp_path/runs."""
    cmd = [sys.executable, "-m", "epirl.cli", "train", *args]
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "WANDB_MODE": "disabled", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=environment, cwd=tmp_path, timeout=timeout)


def output_lines(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


@pytest.mark.parametrize("args, message", [
    (["rl.clip_low=3"], "error: override rl.clip_low=3: Input should be less than or equal to 1"),
    (["rl.stepz=3"], "error: override rl.stepz=3: unknown key 'rl.stepz' (did you mean 'rl.steps'?)"),
    (["data.source=./mydata/train"], "error: data.source: no such file: ./mydata/train"),
    (["data.source=mydata/train.jsonl"], "error: data.source: no such file: mydata/train.jsonl"),
    (["model.path=./no-model"], "error: model.path: ./no-model: no such folder"),
])
def test_bad_input_is_one_line_once_exit_2_and_leaves_nothing(tmp_path, args, message):
    proc = epirl_train(tmp_path, str(RECIPE), "output_dir=runs", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert output_lines(proc) == [message]
    assert sorted(os.listdir(tmp_path)) == [], "a run that failed on its input must leave no folder"


def test_a_hub_id_while_offline_is_one_line_without_retries(tmp_path):
    """`org/name` that is no local path is looked up on the hub: offline that is one line in seconds, not a
    minute of retries. With HF_HUB_OFFLINE unset, the reachability check answers (no network here)."""
    for env in ({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
                {"HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}):
        start = time.perf_counter()
        proc = epirl_train(tmp_path, str(RECIPE), "output_dir=runs", "data.source=mydata/train", env=env)
        assert proc.returncode == 2
        lines = output_lines(proc)
        assert len(lines) == 1 and lines[0].startswith("error: data.source:") and "mydata/train" in lines[0], lines
        assert "Retrying" not in proc.stdout + proc.stderr
        assert time.perf_counter() - start < 120
        assert sorted(os.listdir(tmp_path)) == []


def test_random_weights_of_a_hub_id_while_offline_is_one_line_naming_the_shipped_configs(tmp_path):
    """model.load_format=dummy needs only a config.json: a hub id without a shipped config, with the hub
    unreachable, is one check and one line that names recipes/configs/, not a minute of retries."""
    env = {"HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}
    start = time.perf_counter()
    proc = epirl_train(tmp_path, str(RECIPE), "--dry-run", "model.load_format=dummy", "model.path=Qwen/Qwen3-14B",
                       env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = output_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("error: model.path: Qwen/Qwen3-14B:"), lines
    assert "recipes/configs/" in lines[0] and "Qwen3.5-9B" in lines[0] and "Retrying" not in proc.stderr
    assert time.perf_counter() - start < 60


def test_resume_of_a_missing_run_folder_says_so(tmp_path):
    proc = epirl_train(tmp_path, "--resume", "runs/nope")
    assert proc.returncode == 2
    assert output_lines(proc) == ["error: --resume runs/nope: the run folder does not exist"]


def test_print_config_is_the_resolved_recipe(tmp_path):
    proc = epirl_train(tmp_path, str(RECIPE), "--print-config", "rl.steps=3")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed == load_config(RECIPE, ["rl.steps=3"]).model_dump(mode="json")
    assert printed["rl"]["steps"] == 3 and printed["name"] == "smollm2_arith_cpu"
    assert not (tmp_path / "runs").exists()


def test_help_config_shows_the_recipes_values(tmp_path):
    proc = epirl_train(tmp_path, str(RECIPE), "--help-config", "rl.max_tokens=33", env={"COLUMNS": "250"})
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if " rl.max_tokens " in line)
    assert "33" in row and "256" in row  # the recipe's value (with the override) and the default
    lr = next(line for line in proc.stdout.splitlines() if " trainer.lr " in line)
    assert "0.0002" in lr


@pytest.mark.timeout(600)
def test_dry_run_checks_everything_and_writes_nothing(tmp_path):
    proc = epirl_train(tmp_path, str(RECIPE), "--dry-run", "output_dir=runs")
    lines = output_lines(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines[-1].startswith("dry run: data, model, engine arguments and memory plan are valid")
    for label in ("model", "engine", "trainer", "rl", "memory"):
        assert any(line.startswith(label + " ") for line in lines), label
    assert len(lines) <= 10, lines
    assert not (tmp_path / "runs").exists()
    # vLLM's own validation of the engine arguments runs too: a value it refuses is one line, exit 2
    bad = epirl_train(tmp_path, str(RECIPE), "--dry-run", "output_dir=runs", "engine.vllm_args.max_num_batched_tokens=1")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert output_lines(bad)[-1].startswith("error: engine: vLLM refuses the engine arguments")


@pytest.mark.timeout(900)
def test_an_engine_that_fails_to_start_shows_the_log_tail_and_keeps_it_as_failed(tmp_path):
    """A real error after the inputs were checked: never swallowed (exit 1, the end of train.log is shown), and
    the new run folder is renamed to <name>.failed with its log."""
    proc = epirl_train(tmp_path, str(RECIPE), "output_dir=runs", "name=boom", "engine.vllm_args.max_num_batched_tokens=1")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "error:" in output and "end of runs/boom.failed/train.log" in output
    assert "Traceback" in output  # the tail of the log carries the traceback
    assert not (tmp_path / "runs" / "boom").exists()
    assert "max_num_batched_tokens" in (tmp_path / "runs" / "boom.failed" / "train.log").read_text()


def test_thread_plan_follows_idle_cores_and_warns_once_when_oversubscribed():
    from epirl.cpu_threads import plan_threads

    idle = plan_threads(cores=8, load_1min=0.4, env_threads="")
    assert idle.threads == 8 and idle.warning() is None
    busy = plan_threads(cores=2, load_1min=7.5, env_threads="")
    assert busy.threads == 1 and busy.oversubscribed
    assert "oversubscribed" in busy.warning() and "7.5 on 2 cores" in busy.warning()
    assert "1 thread" in busy.warning() and "thread" not in busy.warning(applied=False)  # a CUDA trainer
    assert plan_threads(cores=4, load_1min=1.6, env_threads="").threads == 2
    user = plan_threads(cores=2, load_1min=9.0, env_threads="3")
    assert user.threads == 3 and user.from_env and "OMP_NUM_THREADS" in user.describe()
