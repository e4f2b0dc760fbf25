"""`epirl compare`: planning, resumption, the held-out split, the statistics and the summary files on synthetic run
folders (fast: no engine starts), `--nproc` scheduling with tiny subprocesses, and the real command on the CPU
recipe (slow)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats
import pytest
import torch
from safetensors.torch import save_file

from epirl.checkpoint import ADAPTER_FOLDER, STATE_FILE, TRAINER_STATE_FILE, checkpoint_dir
from epirl.compare import stats
from epirl.compare.collect import collect_study
from epirl.compare.execute import Launch, ProcessLauncher, StudyExecutor, worker_gpus
from epirl.compare.heldout import HELDOUT_SEED, heldout_problems, overlap, problem_key
from epirl.compare.plan import Action, decide_action, eval_meta, plan_study, train_command
from epirl.compare.report import write_summary
from epirl.compare.spec import (BUILTIN_PAIRINGS, CompareInputError, CompareSpec, Pairing, parse_seeds,
                                read_pairings_file, select_pairings)
from epirl.compare.study import run_study
from epirl.cli import main as cli_main
from epirl.config import dump_config, load_config
from epirl.data import PromptStream, arithmetic_problems, load_problems
from epirl.model.adapter_io import peft_adapter_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2_arith_cpu.yaml"


def make_spec(tmp_path: Path, pairings: str = "bf16,w8a16", seeds: str = "2", **fields) -> CompareSpec:
    overrides = (f"output_dir={tmp_path}", "rl.steps=3", *fields.pop("overrides", ()))
    return CompareSpec(recipe=RECIPE, pairings=select_pairings(pairings), seeds=parse_seeds(seeds),
                       overrides=overrides, resamples=500, **fields)


# ------------------------------------------------------------------------------------------------ synthetic runs
def write_adapter(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"base_model.model.layers.0.q_proj.lora_A.weight": torch.zeros(2, 4)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(peft_adapter_config(2, 4.0, ["q_proj"])))


def step_row(step: int, seed: int, engine: str) -> dict:
    """A metrics.jsonl row with the keys the summary reads; values depend on the step, seed and engine."""
    kl = {"bf16": 1e-4, "w8a16": 1.1e-4}.get(engine, 5e-3) * (1 + 0.1 * seed)
    return {"step": step, "reward/mean": 0.1 * step + 0.01 * seed, "mismatch/k3_kl": kl, "is/clipped_frac": 0.01,
            "mismatch/bitwise_frac": 1.0 - 0.1 * seed / step,
            "probe/arrival_vs_old": 1.0 - 0.05 * step, "probe/separation_vs_old": 4.0 * step,
            "probe/arrival_vs_base": 0.99, "probe/separation_vs_base": 20.0,
            "time/generate_s": 2.0, "time/train_s": 1.0, "time/probe_s": 0.5, "time/step_s": 3.5,
            "mem/cpu_peak_rss_gib": 3.0 + step}


def write_run(run_dir: Path, config, steps_done: int, *, adapter: bool = True, probe_stop: bool = False) -> None:
    """A run folder as `epirl train` leaves it: config.yaml, metrics.jsonl (NaN where the loop writes it), adapter/."""
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.yaml")
    rows = [step_row(step, config.seed, config.engine.precision) for step in range(1, steps_done + 1)]
    if rows:
        rows[0]["mismatch/k3_kl"] = float("nan")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    stop = "ERROR training failed\nepirl.rl.probe.ProbeMismatch: the engine does not serve the adapter\n"
    (run_dir / "train.log").write_text("INFO step lines\n" + (stop if probe_stop else ""))
    if adapter:
        write_adapter(run_dir / "adapter")


def write_checkpoint(run_dir: Path, step: int) -> None:
    folder = checkpoint_dir(run_dir, step)
    write_adapter(folder / ADAPTER_FOLDER)
    torch.save({"optimizer": {}}, folder / TRAINER_STATE_FILE)
    (folder / STATE_FILE).write_text(json.dumps({"step": step, "data": {"cursor": 4}, "world_size": 1}))


def write_heldout_records(plan, run, accuracy: float) -> None:
    """Held-out records as the evaluator writes them: one greedy verdict per problem, correct with `accuracy`."""
    out = run.run_dir / "heldout"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(run.name)
    records = [{"variant": run.name, "benchmark": "heldout", "problem_id": p.uid, "sample": 0,
                "correct": rng.random() < accuracy} for p in plan.split.heldout]
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pooled = {"accuracy": sum(r["correct"] for r in records) / len(records), "problems": len(records)}
    (out / "eval.json").write_text(json.dumps({"variants": {run.name: {"pooled": pooled}}}))
    (out / "meta.json").write_text(json.dumps(eval_meta(plan)))


# ------------------------------------------------------------------------------------------------ planning
def test_plan_names_overrides_and_writes_nothing(tmp_path):
    spec = make_spec(tmp_path, overrides=("rl.max_tokens=16",))
    plan = plan_study(spec)
    assert [run.name for run in plan.runs] == ["smollm2_arith_cpu_bf16_s0", "smollm2_arith_cpu_bf16_s1",
                                               "smollm2_arith_cpu_w8a16_s0", "smollm2_arith_cpu_w8a16_s1"]
    study = tmp_path / "compare_smollm2_arith_cpu"
    assert plan.study_dir == study and all(run.run_dir == study / "runs" / run.name for run in plan.runs)
    run = plan.runs[3]
    assert run.overrides[:3] == (f"name={run.name}", "seed=1", f"output_dir={study / 'runs'}")
    # pairing, then the user's overrides (they win), then the training list without the held-out problems
    assert run.overrides[3:6] == BUILTIN_PAIRINGS["w8a16"]
    assert run.overrides[6:8] == ("rl.steps=3", "rl.max_tokens=16")  # the user's output_dir placed the study
    assert all(r.config.run_dir == r.run_dir for r in plan.runs)
    assert run.overrides[-4:] == (f"data.source={(study / 'data' / 'train_s1.jsonl').resolve()}", "data.format=math",
                                  "data.instruction=", "data.limit=null")
    config = run.config
    assert (config.engine.precision, config.trainer.base, config.rl.correction) == ("w8a16", "fp8", "none")
    assert (config.seed, config.rl.steps, config.rl.max_tokens, config.data.instruction) == (1, 3, 16, "")
    assert all(r.action == Action.START for r in plan.runs)
    command = train_command(plan, run)
    assert command[:5] == [sys.executable, "-m", "epirl.cli", "train", str(RECIPE)] and "--resume" not in command
    assert list(tmp_path.iterdir()) == []  # planning checks, it never writes


def test_builtin_pairings_match_the_recipes():
    main = load_config(ROOT / "recipes" / "qwen35_9b_dapo.yaml")
    w8a8 = load_config(RECIPE, list(BUILTIN_PAIRINGS["w8a8"]))
    assert (w8a8.engine.precision, w8a8.trainer.base, w8a8.rl.correction) == \
        (main.engine.precision, main.trainer.base, main.rl.correction)  # `w8a8` is the main recipe's default
    notis = load_config(RECIPE, list(BUILTIN_PAIRINGS["w8a8-notis"]))
    assert (notis.engine.precision, notis.trainer.base, notis.rl.correction) == ("w8a8", "shared", "none")


def test_existing_run_folders_decide_skip_stop_resume_restart(tmp_path, capsys):
    spec = make_spec(tmp_path, pairings="bf16,w8a16,w8a8", seeds="0,1")
    planned = {run.name: run for run in plan_study(spec).runs}
    finished, stopped, resumable, broken, dead = (planned[f"smollm2_arith_cpu_{name}"] for name in
                                                  ("bf16_s0", "bf16_s1", "w8a16_s0", "w8a16_s1", "w8a8_s0"))
    write_run(finished.run_dir, finished.config, 3)
    write_run(stopped.run_dir, stopped.config, 1, adapter=False, probe_stop=True)
    write_run(resumable.run_dir, resumable.config, 2, adapter=False)
    write_checkpoint(resumable.run_dir, 2)
    write_run(broken.run_dir, broken.config, 1, adapter=False)
    write_checkpoint(broken.run_dir, 1)
    (broken.run_dir / "checkpoints" / "step_000001" / TRAINER_STATE_FILE).write_bytes(b"cut")  # damaged: unusable
    dead.run_dir.mkdir(parents=True)
    (dead.run_dir / "train.log").write_text("died before config.yaml\n")

    plan = plan_study(spec)
    actions = {run.name: run.action for run in plan.runs}
    assert actions == {finished.name: Action.SKIP, stopped.name: Action.STOPPED, resumable.name: Action.RESUME,
                       broken.name: Action.RESTART, dead.name: Action.RESTART,
                       "smollm2_arith_cpu_w8a8_s1": Action.START}
    resume = next(run for run in plan.runs if run.action == Action.RESUME)
    assert train_command(plan, resume)[-2:] == ["--resume", str(resumable.run_dir)]

    launched = []
    code = run_study(spec, launcher=lambda launch: launched.append((launch.kind, launch.run.name)) or 1)
    assert code == 1  # the fake trains nothing: the started runs stay unfinished
    assert (dead.run_dir.with_name(dead.name + ".old") / "train.log").is_file()  # moved aside, not removed
    assert broken.run_dir.with_name(broken.name + ".old").is_dir()
    assert "moved to" in capsys.readouterr().err
    trained = {name for kind, name in launched if kind == "train"}
    assert trained == {resumable.name, broken.name, dead.name, "smollm2_arith_cpu_w8a8_s1"}
    assert ("eval", finished.name) in launched  # finished earlier, its held-out records are still missing


def test_a_run_folder_with_other_settings_is_refused(tmp_path):
    spec = make_spec(tmp_path)
    run = plan_study(spec).runs[0]
    write_run(run.run_dir, load_config(RECIPE, [*run.overrides, "rl.max_tokens=8"]), 3)
    with pytest.raises(CompareInputError, match=r"was made with other settings \(rl\.max_tokens 8 ≠ 32\)"):
        plan_study(spec)
    assert decide_action(load_config(RECIPE, [*run.overrides, "rl.max_tokens=8"]), run.run_dir) == Action.SKIP


# ------------------------------------------------------------------------------------------------ held-out set
class CharTokenizer:
    """Enough of a tokenizer for PromptStream: the chat template is the joined message texts."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, enable_thinking):
        return [ord(c) for c in "\n".join(m["content"] for m in messages)]


def test_heldout_set_is_disjoint_from_every_training_stream(tmp_path):
    spec = make_spec(tmp_path, pairings="bf16", seeds="5")
    plan = plan_study(spec)
    heldout = plan.split.heldout
    assert len(heldout) == 500 and len({problem_key(p) for p in heldout}) == 500
    plan.split.write()
    recipe_config = load_config(RECIPE)
    for run in plan.runs:
        training = load_problems(run.config.data, run.config.seed)  # what the run itself loads: the written file
        assert training and not overlap(training, heldout)
        # the training prompts are the recipe's own prompts for this seed, in its order, minus the held-out ones
        recipe_list = [p for p in load_problems(recipe_config.data, run.seed) if problem_key(p) not in
                       {problem_key(h) for h in heldout}]
        assert [problem_key(p) for p in training] == [problem_key(p) for p in recipe_list]
        assert [p.ground_truth for p in training] == [p.ground_truth for p in recipe_list]
        stream = PromptStream(training, CharTokenizer(), seed=run.seed, shuffle=True, thinking=False,
                              max_prompt_tokens=1024)
        drawn = {prompt.problem.messages[-1]["content"] for prompt in stream.take(5 * len(training))}
        assert not drawn & {problem_key(p) for p in heldout}  # five epochs of the stream: never a held-out problem
    # the held-out problems are the task's own (same prompt form and answers as the generator's)
    generated = {problem_key(p): p.ground_truth for p in arithmetic_problems(20_000, 20, ["+", "-"], 0,
                                                                             "Answer with just the number.")}
    assert all(generated[problem_key(p)] == p.ground_truth for p in heldout)
    # seeded in its own namespace: the same set whatever the run seeds, and not any run seed's draw
    assert [problem_key(p) for p in heldout_problems(recipe_config.data, 500)] == [problem_key(p) for p in heldout]
    assert isinstance(HELDOUT_SEED, str)


def test_heldout_set_too_large_for_the_task_is_refused(tmp_path):
    with pytest.raises(CompareInputError, match="882 distinct arithmetic problems"):
        plan_study(make_spec(tmp_path, heldout_size=882))


# ------------------------------------------------------------------------------------------------ statistics
def test_bootstrap_intervals_cover_the_truth_in_a_seeded_simulation():
    """Problems with difficulties p_j; each seed's adapter answers problem j right with p_j (pairing b: p_j + 0.05).
    The 95 % intervals of the accuracy (truth E[p]) and of the paired difference (truth 0.05) cover the truth in
    about 95 % of simulated studies."""
    rng = np.random.default_rng(0)
    studies, problems, seeds = 200, 300, 3
    population = rng.beta(2, 2, size=2_000_000)
    truth_b_minus_a = float(np.mean(np.minimum(population + 0.05, 1.0) - population))  # 0.05 less the clipped tail
    covered_accuracy = covered_difference = 0
    for study in range(studies):
        difficulty = rng.beta(2, 2, size=problems)  # E[p] = 0.5
        a = rng.random((seeds, problems)) < difficulty
        b = rng.random((seeds, problems)) < np.minimum(difficulty + 0.05, 1.0)
        covered_accuracy += stats.accuracy_interval(a, resamples=999, seed=study).covers(0.5)
        covered_difference += stats.paired_difference(b, a, resamples=999, seed=study).covers(truth_b_minus_a)
    # binomial(200, 0.95): 0.95 ± 3 s.d. = [0.90, 1.0]
    assert 0.90 <= covered_accuracy / studies <= 1.0
    assert 0.88 <= covered_difference / studies <= 1.0


def test_paired_difference_is_tighter_than_unpaired_and_exact_on_known_data():
    rng = np.random.default_rng(1)
    difficulty = rng.random(400)
    a = (rng.random((3, 400)) < difficulty).astype(float)
    b = a.copy()
    b[:, :20] = 1.0  # b fixes 20 problems for every seed
    paired = stats.paired_difference(b, a, resamples=2000)
    assert paired.estimate == pytest.approx(float((b.mean(0) - a.mean(0)).mean()))
    assert paired.low > 0  # a consistent improvement on the same problems is resolved ...
    width_a = stats.accuracy_interval(a, resamples=2000)
    assert paired.high - paired.low < (width_a.high - width_a.low) / 2  # ... far tighter than one accuracy's interval
    same = stats.paired_difference(a, a)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    assert stats.worst_arrival([0.9, 1.3, 0.8, math.nan]) == 1.3
    with pytest.raises(ValueError):
        stats.paired_difference(a, a[:, :10])


def test_seed_interval_is_welchs_and_covers_the_truth_in_a_seeded_simulation():
    # known numbers: means 0.591 and 0.535, Welch's interval from scipy's t distribution by hand
    a, b = np.array([0.646, 0.554, 0.574]), np.array([0.568, 0.574, 0.462])
    interval = stats.seed_difference(b, a)
    va, vb = a.var(ddof=1) / 3, b.var(ddof=1) / 3
    dof = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)
    half = scipy_stats.t.ppf(0.975, dof) * math.sqrt(va + vb)
    assert interval.estimate == pytest.approx(b.mean() - a.mean())
    assert (interval.low, interval.high) == pytest.approx((interval.estimate - half, interval.estimate + half))
    assert interval.covers(0.0)  # a 5.6-point gap is not resolved by three seeds with this spread
    assert stats.seed_difference([0.5], a) is None
    assert stats.seed_difference([0.6, 0.6], [0.5, 0.5]).as_dict() == pytest.approx(
        {"estimate": 0.1, "ci_low": 0.1, "ci_high": 0.1})
    rng, covered = np.random.default_rng(2), 0
    for _ in range(200):  # seeds drawn around true means 0.60 / 0.55: the interval covers +0.05 about 95 % of the time
        covered += stats.seed_difference(rng.normal(0.60, 0.05, 3), rng.normal(0.55, 0.05, 3)).covers(0.05)
    assert 0.88 <= covered / 200 <= 1.0


# ------------------------------------------------------------------------------------------------ summary files
def test_summary_files_from_synthetic_run_folders(tmp_path):
    spec = make_spec(tmp_path, pairings="bf16,w8a16,w8a8", seeds="2")
    plan = plan_study(spec)
    plan.split.write()
    accuracy = {"bf16": 0.6, "w8a16": 0.62, "w8a8": 0.3}
    for run in plan.runs:
        if run.pairing.name == "w8a8" and run.seed == 1:
            write_run(run.run_dir, run.config, 1, adapter=False, probe_stop=True)
            continue
        write_run(run.run_dir, run.config, 3)
        write_heldout_records(plan, run, accuracy[run.pairing.name])
    results, summaries = collect_study(plan)
    table = write_summary(plan, results, summaries)
    study = plan.study_dir
    assert (study / "summary.md").read_text().count("\n| ") == 4  # header + 3 pairings (one table)
    assert table.splitlines()[0].startswith("| pairing |") and len(table.splitlines()) == 5
    assert (study / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads((study / "summary.json").read_text())
    bf16, w8a16, w8a8 = (document["pairings"][name] for name in ("bf16", "w8a16", "w8a8"))
    assert (bf16["engine"], bf16["trainer_base"], bf16["correction"]) == ("bf16", "bf16", "tis")
    assert bf16["finished"] == 2 and bf16["probe_stops"] == []
    assert w8a8["probe_stops"] == [{"seed": 1, "step": 2}] and w8a8["heldout"]["seeds_evaluated"] == [0]
    # median over steps (the NaN of step 1 skipped), then the mean over seeds
    assert bf16["kl_median"] == pytest.approx(np.mean([1e-4, 1.1e-4]))
    assert w8a16["kl_vs_reference"] == pytest.approx(1.1)
    assert bf16["bitwise_frac_lowest"] == pytest.approx(0.9)  # seed 1's step 1: the lowest step of any run
    assert bf16["final_reward"] == pytest.approx(np.mean([0.2, 0.21]))  # mean of steps 1-3, mean over seeds
    assert bf16["probe_arrival_vs_old"] == {"median": pytest.approx(0.875), "worst": pytest.approx(0.85),
                                            "resolved_steps": 4}  # steps 2 and 3 of 2 seeds: separation >= 8
    assert bf16["seconds_per_step"]["generate"] == 2.0 and bf16["memory_peak"]["cpu_peak_rss_gib"] == 6.0
    held = bf16["heldout"]
    accuracy_block = held["accuracy"]
    assert held["problems"] == 500 and accuracy_block["ci_low"] < accuracy_block["estimate"] < accuracy_block["ci_high"]
    assert held["vs_reference"] is None and w8a8["heldout"]["vs_reference"]["estimate"] < -0.2
    assert held["vs_reference_over_seeds"] is None  # the reference itself; w8a8 has one evaluated seed: undefined
    assert w8a8["heldout"]["vs_reference_over_seeds"] is None
    over_seeds = w8a16["heldout"]["vs_reference_over_seeds"]
    per_seed = {name: list(document["pairings"][name]["heldout"]["per_seed"].values()) for name in ("bf16", "w8a16")}
    assert over_seeds["estimate"] == pytest.approx(np.mean(per_seed["w8a16"]) - np.mean(per_seed["bf16"]))
    assert over_seeds["ci_low"] < over_seeds["estimate"] < over_seeds["ci_high"]
    assert {r["name"]: r["state"] for r in document["runs"]}["smollm2_arith_cpu_w8a8_s1"] == "stopped"
    assert "**1**: s1 at step 2" in (study / "summary.md").read_text()
    assert document["runs_per_gpu"] == 1 and "--runs-per-gpu" not in (study / "summary.md").read_text()
    shared = plan_study(dataclasses.replace(spec, runs_per_gpu=3))
    write_summary(shared, results, summaries)
    assert "Runs shared each GPU 3 at a time (--runs-per-gpu)" in (study / "summary.md").read_text()
    assert json.loads((study / "summary.json").read_text())["runs_per_gpu"] == 3


def fake_launcher(eval_accuracy: float = 0.5):
    """Stands in for `epirl train` / the evaluator in-process: writes what they would write."""
    def launch(launch: Launch) -> int:
        run = launch.run
        if launch.kind == "train":
            write_run(run.run_dir, run.config, run.config.rl.steps)
            return 0
        out = Path(launch.command[launch.command.index("--out") + 1])
        problems = [json.loads(line) for line in Path(launch.command[launch.command.index("--problems") + 1])
                    .read_text().splitlines()]
        out.mkdir(parents=True, exist_ok=True)
        rng = random.Random(run.name)
        verdicts = [{"problem_id": p["id"], "correct": rng.random() < eval_accuracy} for p in problems]
        (out / "records.jsonl").write_text("".join(json.dumps(verdict) + "\n" for verdict in verdicts))
        (out / "meta.json").write_text(launch.command[launch.command.index("--meta") + 1])
        return 0
    return launch


def test_whole_study_with_a_fake_runner_then_repeated(tmp_path, capsys):
    spec = make_spec(tmp_path, seeds="2")
    launched = []
    launcher = fake_launcher()
    assert run_study(spec, launcher=lambda launch: launched.append(launch.kind) or launcher(launch)) == 0
    captured = capsys.readouterr()
    progress = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert len(progress) == 4 and all("trained 3/3 steps" in line for line in progress)
    assert captured.out.startswith("| pairing |")
    assert launched == ["train", "eval"] * 4
    launched.clear()
    assert run_study(spec, launcher=lambda launch: launched.append(launch.kind) or 0) == 0
    assert launched == []  # every run finished and evaluated: nothing is redone
    assert "4 finished earlier" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ --nproc
SLEEPER = """
import json, os, sys, time
record, running = sys.argv[1], sys.argv[2]
marker = os.path.join(running, os.path.basename(record))
open(marker, "w").close()
start, peak = time.time(), 0
while time.time() - start < 3 and peak < 2:  # wait (a little) for a run beside this one
    peak = max(peak, len(os.listdir(running)))
    time.sleep(0.02)
time.sleep(0.3)
peak = max(peak, len(os.listdir(running)))
os.remove(marker)
span = {"gpu": os.environ["CUDA_VISIBLE_DEVICES"], "start": start, "end": time.time(), "peak": peak}
json.dump(span, open(record, "w"))
"""


def run_sleepers(tmp_path: Path, nproc: int, runs_per_gpu: int = 1) -> tuple[list, list[dict]]:
    """A study of four runs, each a real (tiny) process that records its GPU, its time span and the most processes it
    saw running beside it; returns (outcomes, spans)."""
    plan = plan_study(make_spec(tmp_path, seeds="2"))
    records, running = tmp_path / "records", tmp_path / "running"
    records.mkdir()
    running.mkdir()

    def sleeper(launch: Launch) -> int:
        return subprocess.run([sys.executable, "-c", SLEEPER, str(records / f"{launch.run.name}.json"), str(running)],
                              env=launch.env).returncode

    outcomes = StudyExecutor(plan, sleeper).run(nproc=nproc, runs_per_gpu=runs_per_gpu)
    return outcomes, [json.loads(path.read_text()) for path in sorted(records.iterdir())]


def test_nproc_runs_side_by_side_one_gpu_each(tmp_path, monkeypatch):
    """Four runs over two workers: never more than two at once, two at once at some point, never two at once on one
    GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    outcomes, spans = run_sleepers(tmp_path, nproc=2)
    assert len(outcomes) == 4 and len(spans) == 4 and {span["gpu"] for span in spans} == {"5", "7"}
    assert max(span["peak"] for span in spans) == 2  # side by side, and never more than --nproc
    for i, first in enumerate(spans):
        beside = [other for other in spans[i + 1:] if other["start"] < first["end"] and first["start"] < other["end"]]
        assert all(other["gpu"] != first["gpu"] for other in beside)


def test_runs_per_gpu_puts_runs_beside_each_other_on_one_gpu(tmp_path, monkeypatch):
    """--runs-per-gpu 2 on one GPU: two runs at once, both on that GPU; the GPUs are taken in turn by the workers."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    outcomes, spans = run_sleepers(tmp_path, nproc=1, runs_per_gpu=2)
    assert len(outcomes) == 4 and {span["gpu"] for span in spans} == {"5"}
    assert max(span["peak"] for span in spans) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    assert worker_gpus(2, 3) == ["1", "2", "1", "2", "1", "2"]


@pytest.mark.parametrize("overrides, message", [
    (["engine.gpu_memory_utilization=0.5"], "error: --runs-per-gpu 2: 2 engines × engine.gpu_memory_utilization 0.5 "
                                            "is more than 0.9 of a GPU; set engine.gpu_memory_utilization=0.45 or lower"),
    (["engine.gpu_memory_utilization=0.4"], "error: --runs-per-gpu 2: runs sharing a GPU need a fixed KV cache; set "
                                            "engine.vllm_args.kv_cache_memory_bytes (e.g. 2147483648 for 2 GiB)"),
])
def test_runs_per_gpu_that_cannot_share_a_gpu_are_refused(tmp_path, monkeypatch, capsys, overrides, message):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    spec = make_spec(tmp_path, runs_per_gpu=2, overrides=overrides)
    assert run_study(spec, launcher=lambda launch: pytest.fail("nothing may start")) == 2
    assert capsys.readouterr().err.strip() == message
    fits = make_spec(tmp_path, runs_per_gpu=2, dry_run=True, overrides=[
        "engine.gpu_memory_utilization=0.4", "engine.vllm_args.kv_cache_memory_bytes=2147483648"])
    assert run_study(fits, launcher=lambda launch: pytest.fail("nothing may start")) == 0
    assert "4 start; 2 side by side (2 per GPU)" in capsys.readouterr().err


def test_sigterm_ends_the_running_processes_and_starts_no_more(tmp_path, capsys):
    """`timeout` ending a device call: the study exits 143 at once, its running process ended, no next run started."""
    launched = []

    class Sleepers(ProcessLauncher):
        def __call__(self, launch: Launch) -> int:
            launched.append(launch.run.name)
            return super().__call__(dataclasses.replace(launch, command=[sys.executable, "-c",
                                                                         "import time; time.sleep(120)"]))

    before, threads_before = signal.getsignal(signal.SIGTERM), threading.active_count()
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    started = time.perf_counter()
    try:
        code = run_study(make_spec(tmp_path, pairings="bf16"), launcher=Sleepers())
    finally:
        timer.cancel()
    assert code == 143 and time.perf_counter() - started < 30
    assert launched == ["smollm2_arith_cpu_bf16_s0"]
    err = capsys.readouterr().err
    assert "[1/2] bf16 s0: failed (exit -15)" in err and "terminated" in err  # its worker ended before the study
    assert threading.active_count() == threads_before
    assert signal.getsignal(signal.SIGTERM) in (before, signal.SIG_DFL)  # the study's handler is gone again


def test_nproc_larger_than_the_visible_gpus_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert run_study(make_spec(tmp_path, nproc=2), launcher=lambda launch: pytest.fail("nothing may start")) == 2
    assert capsys.readouterr().err.strip() == "error: --nproc 2: only 1 GPU(s) visible (3)"
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ input
def test_pairings_file_lists_and_mappings(tmp_path):
    path = tmp_path / "pairings.yaml"
    path.write_text("mis:\n  - engine.precision=w8a8\n  - rl.correction=mis\n"
                    "shared16:\n  engine: {precision: w8a16}\n  trainer: {base: shared}\n  rl: {correction: none}\n")
    pairings = read_pairings_file(path)
    assert pairings["mis"] == Pairing("mis", ("engine.precision=w8a8", "rl.correction=mis"), builtin=False)
    assert pairings["shared16"].overrides == ("engine.precision=w8a16", "trainer.base=shared", "rl.correction=none")
    assert [p.name for p in select_pairings("bf16,shared16", str(path))] == ["bf16", "shared16"]
    plan = plan_study(CompareSpec(recipe=RECIPE, pairings=select_pairings("shared16", str(path)), seeds=(0,),
                                  overrides=(f"output_dir={tmp_path}",)))
    assert plan.runs[0].config.trainer.base == "shared" and plan.runs[0].name == "smollm2_arith_cpu_shared16_s0"
    for text, message in (("bf16: [rl.correction=none]\n", "is a built-in pairing"), ("- a\n", "must be a mapping"),
                          ("x: 3\n", "list of key=value"), ("x: [rl.correction]\n", "not of the form"),
                          ("a b: [rl.steps=2]\n", "may only hold")):
        path.write_text(text)
        with pytest.raises(CompareInputError, match=message):
            read_pairings_file(path)


@pytest.mark.parametrize("argv, message", [
    (["--pairings", "bf16,fp4"], "--pairings: unknown pairing 'fp4' (known: bf16, w8a16, w8a16-bitwise, w8a8, w8a8-notis)"),
    (["--pairings", "bf16,bf16"], "--pairings bf16,bf16: a pairing is listed twice"),
    (["--seeds", "two"], "--seeds two: give a count (3 = seeds 0, 1, 2) or a comma list of seeds (0,5,7)"),
    (["--seeds", "1,1"], "--seeds 1,1: a seed is listed twice"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["rl.stepz=2"], "override rl.stepz=2: unknown key 'rl.stepz' (did you mean 'rl.steps'?)"),
    (["--seeds", "2", "rl.steps=x"],
     "override rl.steps=x: Input should be a valid integer, unable to parse string as an integer"),
    (["engine.precision=w8a8"], "override engine.precision=w8a8: engine.precision is set by pairing 'w8a8-notis'; "
                                "define a pairing with --pairings-file instead"),
    (["seed=4"], "override seed=4: the study sets seed per run; use --seeds"),
    (["--pairings-file", "missing.yaml"], "--pairings-file missing.yaml: no such file"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capfd, argv, message):
    capfd.readouterr()
    code = compare_main([str(RECIPE), f"output_dir={tmp_path}", *argv])
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and lines == [f"error: {message}"]
    assert list(tmp_path.iterdir()) == []


def test_missing_recipe_and_usage_errors(tmp_path, capfd):
    capfd.readouterr()
    assert compare_main([str(tmp_path / "nope.yaml")]) == 2
    assert capfd.readouterr().err.strip() == f"error: recipe file not found: {tmp_path / 'nope.yaml'}"
    with pytest.raises(SystemExit) as exit_info:
        compare_main([str(RECIPE), "--nproc", "two"])
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(lines) == 1 and "--nproc: invalid int value: 'two'" in lines[0]


def test_help_shows_defaults_and_the_pairings_file(capsys):
    with pytest.raises(SystemExit):
        compare_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for expected in ("--pairings PAIRINGS comma-separated pairing names", "(default: bf16,w8a16,w8a8,w8a8-notis)",
                     "(default: 3)", "--nproc NPROC", "(default: 1)", "--heldout-size HELDOUT_SIZE", "(default: 500)",
                     "--pairings-file FILE YAML mapping: pairing name -> list of key=value overrides or nested mapping",
                     "its schema refuses unknown keys"):
        assert expected in text


def test_overrides_after_options_are_overrides(tmp_path, capfd):
    capfd.readouterr()
    assert compare_main([str(RECIPE), "--pairings", "bf16", "--seeds", "1", f"output_dir={tmp_path}", "--dry-run",
                         "rl.steps=7"]) == 0
    assert "1 runs of 7 steps" in capfd.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ the real command
TINY = ["rl.prompts_per_step=2", "rl.samples_per_prompt=4", "rl.max_tokens=16", "reward.workers=1",
        "tracking.wandb=disabled", "engine.probe_prompts=2", "model.max_model_len=256"]


def compare_main(argv: list[str]) -> int:
    return cli_main(["compare", *argv])


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_compare_on_the_cpu_recipe(tmp_path):
    """bf16 and w8a16, two seeds, two steps each, real engines; held-out evaluation of every adapter."""
    command = [sys.executable, "-m", "epirl.cli", "compare", str(RECIPE), "--pairings", "bf16,w8a16", "--seeds", "2",
               "--steps", "2", "--heldout-size", "24", "--resamples", "1000", f"output_dir={tmp_path}", *TINY]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=3500, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = tmp_path / "compare_smollm2_arith_cpu"
    for name in ("summary.md", "summary.json", "curves.png"):
        assert (study / name).is_file()
    document = json.loads((study / "summary.json").read_text())
    assert [run["state"] for run in document["runs"]] == ["finished"] * 4
    assert all(run["steps"] == 2 and run["heldout_accuracy"] is not None for run in document["runs"])
    assert document["pairings"]["w8a16"]["heldout"]["vs_reference"] is not None
    assert len([line for line in proc.stderr.splitlines() if line.startswith("[")]) == 4
    print(proc.stdout)
