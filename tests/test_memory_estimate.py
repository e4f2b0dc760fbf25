"""The trainer's activation estimate (epirl.model.memory.activation_estimate) is an upper bound of the peak.

Two anchors: the H200 measurement of the main recipe at 9B (pinned numbers), and the real trainer micro-batch
measured here on CPU (torch.profiler's allocation events: the peak of live bytes above what stays allocated).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, LlamaConfig

from epirl.config import ALL_PROJECTIONS, EpirlConfig
from epirl.model.loading import random_policy
from epirl.model.memory import GiB, activation_estimate, entropy_keeps_graph, estimate_trainer_bytes
from epirl.rl.trainer import TrainBatch, build_optimizer, optimizer_step

Q35_MEASURED_GIB = 24.09  # H200, step 2 (the torch-fallback run of `gpu_main_recipe.sh q35`)


def test_q35_main_recipe_estimate_bounds_the_h200_peak():
    """Qwen3.5-9B, 4 x (256 + 2048) tokens, rank 64 on 12 projections, shared FP8 base, checkpointing, chunk 1024,
    GDN torch fallback: measured 24.09 GiB; the estimate must bound it without being absurd (<= 1.5x)."""
    from pathlib import Path

    config = AutoConfig.from_pretrained(Path(__file__).parents[1] / "recipes/configs/Qwen3.5-9B").get_text_config()
    def estimate(**kwargs):
        return estimate_trainer_bytes(config, "shared", 64, list(ALL_PROJECTIONS), 4 * (256 + 2048), True, 1024,
                                      **kwargs)

    # That run's trainer computed the entropy metric with grad (policy.py before 6f1e04d): its graph kept the
    # fp32 log-softmax + exp of every LM-head chunk, 2 x N x V x 4 bytes.
    est = estimate(gdn_kernel="torch", entropy_graph=True)
    gib = est.activation_bytes / GiB
    assert Q35_MEASURED_GIB <= gib <= 36.0, est.activations.terms
    assert est.activations.gdn_kernel == "torch" and "linear_attention" in est.activations.peak
    assert est.activations.terms["entropy_graph"] == 2 * 4 * 2304 * 248320 * 4
    fla = estimate(gdn_kernel="fla", entropy_graph=True)
    assert fla.activations.gdn_kernel == "fla" and fla.activation_bytes < est.activation_bytes
    # Today's trainer computes the entropy without grad: the term is gone, and the estimate still bounds what the
    # measurement implies without it (24.09 - 17.04 GiB, the same top-layer peak).
    assert not entropy_keeps_graph()
    today = estimate(gdn_kernel="torch")
    assert "entropy_graph" not in today.activations.terms
    assert Q35_MEASURED_GIB - 2 * 4 * 2303 * 248320 * 4 / GiB <= today.activation_bytes / GiB <= 1.5 * 7.05


@pytest.mark.parametrize("base", ["shared", "bf16"])
def test_q3_main_recipe_estimate_bounds_the_h200_peak(base):
    """Qwen3-8B, 4 x (256 + 2048) tokens, rank 64 on 7 projections, checkpointing, chunk 1024: measured 15.71 GiB
    (steps 2-3, H200, both the shared W8A16 engine run and the bf16-trainer run)."""
    from pathlib import Path

    config = AutoConfig.from_pretrained(Path(__file__).parents[1] / "recipes/configs/Qwen3-8B").get_text_config()
    est = estimate_trainer_bytes(config, base, 64, list(ALL_PROJECTIONS)[:7], 4 * 2304, True, 1024,
                                 entropy_graph=True)  # as in that run (policy.py before 6f1e04d)
    assert 15.71 <= est.activation_bytes / GiB <= 1.5 * 15.71, est.activations.terms
    assert est.activations.gdn_kernel == "none"


def _peak_above_end(fn) -> tuple[int, int]:
    """(peak live CPU bytes allocated inside `fn` above the start, live bytes at its end above the start)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for _, event in sorted(enumerate(events), key=lambda ie: (ie[1].start_ns(), ie[0])):
        live += event.nbytes()
        peak = max(peak, live)
    return peak, live


def _qwen35_config():
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
                             layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                             linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                             linear_num_value_heads=4, max_position_embeddings=1024)


def _llama_config():  # SmolLM2's family (tied embeddings, no q/k norm)
    return LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                       max_position_embeddings=1024)


def _qwen3_config():  # Qwen3-8B's family (q/k RMSNorm, untied)
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
                       max_position_embeddings=1024)


CONFIGS = {"qwen3_5": _qwen35_config, "llama": _llama_config, "qwen3": _qwen3_config}


@pytest.mark.parametrize("arch,checkpointing", [("qwen3_5", True), ("qwen3_5", False), ("llama", True),
                                                pytest.param("llama", False, marks=pytest.mark.slow),  # CI time
                                                ("qwen3", True)])
def test_estimate_bounds_the_measured_trainer_micro_batch_peak(arch, checkpointing):
    """A real optimizer step (2 micro-batches of 2 x 256 tokens, bf16 on CPU, GDN torch fallback) measured
    as the GPU run measures it: peak minus what stays allocated after the step (gradients and AdamW moments
    exist from a first step). The estimate must bound it, and not by more than 2x. (Against the trainer as it
    is: with the entropy's graph back, entropy_keeps_graph() says so and the estimate grows with it.)"""
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    targets = list(ALL_PROJECTIONS) if arch == "qwen3_5" else list(ALL_PROJECTIONS)[:7]
    rank, micro, length, chunk = 16, 2, 256, 128
    policy = random_policy(config, "bf16", "cpu", rank, 2.0 * rank, targets, dtype=torch.bfloat16,
                           gradient_checkpointing=checkpointing)
    cfg = EpirlConfig.model_validate({"model": {"path": "unused"},
                                      "trainer": {"micro_batch_size": micro, "logprob_chunk_tokens": chunk,
                                                  "gradient_checkpointing": checkpointing},
                                      "lora": {"rank": rank, "alpha": 2.0 * rank, "targets": targets}})
    optimizer, scheduler = build_optimizer(policy.lora_parameters(), cfg)
    sequences = 2 * micro
    ids = torch.randint(0, config.vocab_size, (sequences, length + 1))
    mask = torch.zeros(sequences, length, dtype=torch.bool)
    mask[:, 32:] = True
    batch = TrainBatch(ids[:, :-1], ids[:, 1:], mask, -torch.rand(sequences, length) * mask,
                       torch.tensor([1.0, -1.0] * micro))
    optimizer_step(policy, optimizer, scheduler, batch, cfg, "cpu")  # gradients and moments now exist
    peak, end = _peak_above_end(lambda: optimizer_step(policy, optimizer, scheduler, batch, cfg, "cpu"))
    measured = peak - end
    estimate = activation_estimate(config, micro * length, checkpointing, chunk, 2, "torch",
                                   lora_rank=rank, lora_targets=len(targets))
    print(f"\n{arch} checkpointing={checkpointing}: measured {measured / 2**20:.1f} MiB, estimate "
          f"{estimate.total_bytes / 2**20:.1f} MiB ({estimate.peak}) "
          f"{ {k: round(v / 2**20, 1) for k, v in estimate.terms.items()} }")
    assert measured <= estimate.total_bytes <= 2 * measured


def test_plan_prints_the_terms_and_the_gdn_kernel_it_assumed(tmp_path, monkeypatch, caplog):
    """The run's `memory plan` log lines (grepped by scripts/offline/gpu_main_recipe.sh) and the console's memory row
    name the activation terms and the GDN kernel; a benchmark's prompt length replaces the prompt cap."""
    import logging

    from epirl.config import load_config
    from epirl.model.dummy import dummy_model_dir
    from epirl.model.memory import log_memory_plan, memory_plan
    from epirl.plan import memory_line

    monkeypatch.setenv("HOME", str(tmp_path))
    recipes = __import__("pathlib").Path(__file__).parents[1] / "recipes"
    cfg = load_config(recipes / "qwen35_9b_dapo.yaml", ["model.load_format=dummy"])
    cfg.model.path = str(dummy_model_dir(cfg.model.path))
    cfg.model.dtype = "bfloat16"
    plan = memory_plan(cfg, torch.device("cpu"), prompt_tokens=256)
    assert plan["plan/micro_batch_tokens"] == 4 * 2304
    terms = {k: v for k, v in plan.items() if k.startswith("plan/activation/")}
    assert sum(terms.values()) == plan["plan/trainer_activation_bytes"]
    assert {"plan/activation/layer_inputs_bytes", "plan/activation/top_layer_bytes"} <= terms.keys()
    with caplog.at_level(logging.INFO, logger="epirl.model.memory"):
        log_memory_plan(plan)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("memory plan: engine weights") and "activations" in lines[0]
    assert lines[1].startswith("memory plan, trainer activations = layer_inputs 2.25 + head 0.35 + top_layer ")
    assert lines[1].endswith("(GDN layers: transformers' torch fallback assumed)")
    assert memory_line(cfg, torch.device("cpu")).startswith("trainer ≤ ") and "GDN torch fallback assumed" in \
        memory_line(cfg, torch.device("cpu"))
    q3 = load_config(recipes / "qwen3_8b_dapo.yaml", ["model.load_format=dummy"])
    q3.model.path = str(dummy_model_dir(q3.model.path))
    q3.model.dtype = "bfloat16"
    q3_plan = memory_plan(q3, torch.device("cpu"), prompt_tokens=256)
    assert q3_plan["plan/gdn_kernel"] == 0.0 and q3_plan["plan/trainer_activation_bytes"] / GiB < 20
