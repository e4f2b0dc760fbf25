"""Engine pieces that need no running vLLM engine: vLLM boundary helpers, adapter naming, the plugin's
custom op against the kernel it wraps."""

import json

import pytest
import torch

from epirl.engine.vllm_compat import engine_args, kv_cache
from epirl.engine.lora_publish import modules_of
from epirl.model.adapter_io import AdapterConfigError, peft_adapter_config, read_adapter_settings


def test_lora_rank_slot_rounds_up_to_vllm_allowed_ranks():
    assert [engine_args.lora_rank_slot(r) for r in (1, 2, 8, 9, 64, 65, 512)] == [1, 8, 8, 16, 64, 128, 512]
    with pytest.raises(ValueError):
        engine_args.lora_rank_slot(513)


def test_fp8_method_name_matches_this_vllm():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert engine_args.fp8_per_tensor_method() in QUANTIZATION_METHODS


def test_modules_of_groups_peft_names_and_rejects_half_adapters():
    a, b = torch.zeros(4, 8), torch.zeros(6, 4)
    stem = "base_model.model.model.layers.0.self_attn.q_proj"
    mods = modules_of({f"{stem}.lora_A.weight": a, f"{stem}.lora_B.weight": b})
    assert list(mods) == ["model.layers.0.self_attn.q_proj"] and mods["model.layers.0.self_attn.q_proj"][0] is a
    with pytest.raises(ValueError, match="mismatch"):
        modules_of({f"{stem}.lora_A.weight": a})
    with pytest.raises(ValueError, match="not a PEFT"):
        modules_of({f"{stem}.weight": a})
    assert peft_adapter_config(8, 16.0, ["q_proj"])["r"] == 8


def test_adapter_settings_read_from_a_peft_folder_with_one_line_errors(tmp_path):
    folder = tmp_path / "adapter"
    with pytest.raises(AdapterConfigError, match="folder not found"):
        read_adapter_settings(folder)
    folder.mkdir()
    with pytest.raises(AdapterConfigError, match="has no adapter_config.json"):
        read_adapter_settings(folder)
    config = folder / "adapter_config.json"
    config.write_text(json.dumps(peft_adapter_config(8, 16.0, ["model.layers.0.self_attn.q_proj", "v_proj", "q_proj"])))
    assert read_adapter_settings(folder) == (8, 16.0, ["q_proj", "v_proj"])
    config.write_text(json.dumps({"r": 4, "target_modules": "k_proj"}))
    assert read_adapter_settings(folder) == (4, 8.0, ["k_proj"])  # PEFT's default lora_alpha
    config.write_text(json.dumps({"lora_alpha": 16}))
    with pytest.raises(AdapterConfigError, match="no integer 'r'"):
        read_adapter_settings(folder)
    config.write_text(json.dumps({"r": 4, "lora_alpha": "big"}))
    with pytest.raises(AdapterConfigError, match="'lora_alpha' is not a number"):
        read_adapter_settings(folder)


def test_plugin_op_is_the_kernel_per_slice():
    """epirl::w8a16_lora_slices == w8a16_lora called per q/k/v slice (what the trainer computes)."""
    from epirl.engine import plugin
    from epirl.kernels import quantize_weight_fp8, w8a16_lora

    plugin.register()
    g = torch.Generator().manual_seed(0)
    widths, k, r = [16, 8, 8], 24, 4
    codes, scale = quantize_weight_fp8(torch.randn(sum(widths), k, generator=g), group_sizes=widths)
    x = torch.randn(5, k, generator=g).to(torch.bfloat16)
    a = [torch.randn(r, k, generator=g).to(torch.bfloat16) for _ in widths]
    b = [torch.randn(w, r, generator=g).to(torch.bfloat16) for w in widths]
    bias = torch.randn(sum(widths), generator=g).to(torch.bfloat16)
    for bias_ in (None, bias):
        got = torch.ops.epirl.w8a16_lora_slices(x, codes, scale, a, b, widths, 2.0, bias_)
        parts, start = [], 0
        for w, ai, bi in zip(widths, a, b):
            part_bias = None if bias_ is None else bias_[start:start + w]
            parts.append(w8a16_lora(x, codes[start:start + w], scale, ai, bi, 2.0, part_bias))
            start += w
        assert torch.equal(got, torch.cat(parts, -1))
    with pytest.raises(ValueError, match="out: want shape"):
        w8a16_lora(x, codes, scale, out=torch.empty(5, 3, dtype=torch.bfloat16))
    assert torch.equal(torch.ops.epirl.w8a16_lora_slices(x, codes, scale, [], [], widths, 1.0, None),
                       w8a16_lora(x, codes, scale))
    # zero LoRA buffers leave the base result bitwise unchanged (how "no adapter" is served)
    zeros_a, zeros_b = [torch.zeros_like(t) for t in a], [torch.zeros_like(t) for t in b]
    assert torch.equal(torch.ops.epirl.w8a16_lora_slices(x, codes, scale, zeros_a, zeros_b, widths, 2.0, None),
                       w8a16_lora(x, codes, scale))


def test_reacquire_empties_the_trainer_cache_and_names_the_settings_when_the_kv_pool_does_not_fit(monkeypatch):
    """CUDA-only logic, exercised without a GPU: before mapping the KV cache back, the trainer's cached blocks
    are returned (empty_cache) and a pool that no longer fits is a one-line error naming what to change."""
    from epirl.engine import RolloutEngine

    calls = []
    engine = object.__new__(RolloutEngine)  # no vLLM behind it: only the re-acquire bookkeeping runs
    engine._kv_released, engine._kv_released_bytes, engine.llm = True, 40 * 2**30, None
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (30 * 2**30, 140 * 2**30))
    monkeypatch.setattr(kv_cache, "reacquire_kv", lambda llm: calls.append("map") or {})
    with pytest.raises(RuntimeError, match=r"needs 40.00 GiB, 30.00 GiB free.*trainer\.micro_batch_size"):
        engine.reacquire_kv()
    assert calls == ["empty_cache"] and engine._kv_released  # nothing mapped, state unchanged
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (50 * 2**30, 140 * 2**30))
    monkeypatch.setattr(engine, "_checksum_weights", lambda: {})
    engine._weight_checksums = {}
    engine.reacquire_kv()
    assert calls == ["empty_cache", "empty_cache", "map"] and not engine._kv_released


def test_vllm_args_pass_through_checked_and_vl_checkpoints_load_the_language_model_only(tmp_path):
    import json

    from epirl.config import EpirlConfig
    from epirl.engine.engine import llm_kwargs

    def kwargs(model_dir, **vllm_args):
        cfg = EpirlConfig.model_validate({"model": {"path": str(model_dir)}, "engine": {"vllm_args": vllm_args}})
        return llm_kwargs(cfg, str(model_dir), None)

    text, vl = tmp_path / "text", tmp_path / "vl"
    for folder, config in ((text, {"model_type": "qwen3"}), (vl, {"model_type": "qwen3_5", "vision_config": {}})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    assert kwargs(text, gdn_prefill_backend="triton")["gdn_prefill_backend"] == "triton"
    assert "language_model_only" not in kwargs(text)
    assert kwargs(vl)["language_model_only"] is True
    assert kwargs(vl, language_model_only=False)["language_model_only"] is False  # the user's word wins
    with pytest.raises(ValueError, match=r"^engine\.vllm_args\.not_a_vllm_arg: not an argument of vLLM"):
        kwargs(text, not_a_vllm_arg=1)
    with pytest.raises(ValueError, match=r"^engine\.vllm_args\.enable_lora: epirl sets this"):
        kwargs(text, enable_lora=False)


def test_dummy_weights_with_a_tokenizer_folder_pass_it_to_vllm(tmp_path):
    import json

    from epirl.config import EpirlConfig
    from epirl.engine.engine import llm_kwargs

    model_dir, tok_dir = tmp_path / "arch", tmp_path / "tok"
    model_dir.mkdir(), tok_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    cfg = EpirlConfig.model_validate({"model": {"path": str(model_dir), "load_format": "dummy",
                                                "tokenizer": str(tok_dir)}})
    kwargs = llm_kwargs(cfg, str(model_dir), None)
    assert kwargs["load_format"] == "dummy" and kwargs["tokenizer"] == str(tok_dir)
    assert "skip_tokenizer_init" not in kwargs


@pytest.mark.parametrize("layout", ["transposed_view", "row_major", "square_copy_among_views"])
def test_fp8_base_views_are_zero_copy_in_either_vllm_weight_layout(layout):
    """The shared base takes vLLM's FP8 weights whichever way a version holds them (read off a non-square
    weight), never copying; a square weight held otherwise than the model's layout is refused, not transposed."""
    from torch import nn

    from epirl.engine.plugin import fp8_base_views

    def fp8_layer(n, k, widths, held):
        codes_N_K = torch.randn(n, k).to(torch.float8_e4m3fn)
        layer = nn.Module()
        layer.logical_widths, layer.output_size_per_partition = widths, n
        layer.weight_scale = torch.tensor([0.5])
        layer.weight = {"view": codes_N_K.t(), "row_major": codes_N_K, "copy": codes_N_K.t().contiguous()}[held]
        return layer, codes_N_K

    held = "row_major" if layout == "row_major" else "view"
    model = nn.Module()
    qkv, qkv_codes = fp8_layer(10, 6, [4, 3, 3], held)  # non-square: tells the layout
    o, o_codes = fp8_layer(6, 6, [6], "copy" if layout == "square_copy_among_views" else held)
    model.add_module("qkv_proj", qkv)
    model.add_module("o_proj", o)
    if layout == "square_copy_among_views":
        with pytest.raises(RuntimeError, match="o_proj: engine FP8 weight .* cannot share it zero-copy"):
            fp8_base_views(model)
        return
    views = fp8_base_views(model)
    assert sorted(views) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert views["q_proj"][0].data_ptr() == qkv_codes.data_ptr() and views["o_proj"][0].data_ptr() == o_codes.data_ptr()
    assert torch.equal(torch.cat([views[m][0] for m in ("q_proj", "k_proj", "v_proj")]).float(), qkv_codes.float())
    assert torch.equal(views["o_proj"][0].float(), o_codes.float())  # the square one, not its transpose


@pytest.mark.parametrize("precision,cuda,want", [("w8a8", True, "timed"), ("w8a8", False, "env"),
                                                 ("w8a16", True, "env"), ("bf16", True, "env")])
def test_serving_kernels_auto_is_timed_for_w8a8_engines_on_cuda_only(precision, cuda, want):
    from epirl.config import load_config
    from epirl.engine.engine import serving_mode_for

    cfg = load_config(None, [f"engine.precision={precision}", "engine.serving_kernels=auto"])
    assert serving_mode_for(cfg, cuda) == want
    explicit = load_config(None, ["engine.precision=w8a8", "engine.serving_kernels=off"])
    assert serving_mode_for(explicit, True) == "off"


def test_engine_serving_kernels_mode_reaches_vllm_in_the_engine_spec(monkeypatch):
    """engine.serving_kernels: the mode goes to vLLM in the engine's spec (additional_config, which the LoRA layers
    read when vLLM builds them and which keys the compile cache), with the wrappers installed first; no process-wide
    mode is set."""
    import vllm

    from epirl.config import load_config
    from epirl.engine import RolloutEngine, serving_lora
    from epirl.engine.spec import EngineSpec

    seen, installed = [], []

    def fake_llm(**kwargs):
        seen.append(EngineSpec.from_additional_config(kwargs.get("additional_config")))
        raise RuntimeError("no engine in this test")

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    monkeypatch.setattr(serving_lora, "install", lambda: installed.append(True) or 0)
    cfg = load_config(None, ["engine.precision=w8a8", "engine.serving_kernels=timed", "model.path=smollm2",
                             "kernels.serving_vllm_from=64"])
    with pytest.raises(RuntimeError, match="no engine in this test"):
        RolloutEngine(cfg)
    assert installed and [(s.serving_kernels, s.serving_vllm_from, s.lora_rank) for s in seen] == [
        ("timed", 64, cfg.lora.rank)]
