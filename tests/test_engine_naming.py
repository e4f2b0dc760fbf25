"""vLLM ↔ trainer module names on Qwen3.5's real vLLM mappers (no engine start: Qwen3.5's GDN layers do not
run on CPU). The layer tree below mirrors what vLLM 0.32 builds for a Qwen3.5 vision-language checkpoint."""

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")


def qwen35_mappers():
    """The mappers and packing of vLLM 0.32's Qwen3_5ForConditionalGeneration (root) and Qwen3_5Model
    (inner), as written in vllm/model_executor/models/qwen3_5.py and qwen3_vl.py. Rebuilt from vLLM's own
    WeightsMapper here because importing those model modules needs torchvision, which the CPU install drops."""
    from vllm.model_executor.models.utils import WeightsMapper

    root = WeightsMapper(orig_to_new_prefix={"model.visual.": "visual.", "lm_head.": "language_model.lm_head.",
                                             "model.language_model.": "language_model.model.", "mtp.": None})
    inner = WeightsMapper(orig_to_new_stacked={
        ".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)), ".in_proj_z": (".in_proj_qkvz", 3),
        ".in_proj_b": (".in_proj_ba", 0), ".in_proj_a": (".in_proj_ba", 1)})
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
              "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"]}
    return root, inner, packed


def qwen35_like_vllm_model(kd=4, vd=6, hidden=8):
    """Root = Qwen3_5ForConditionalGeneration's mapper and packing; inner model = Qwen3_5Model's mapper."""
    root_mapper, inner_mapper, packed = qwen35_mappers()
    Root = type("Root", (nn.Module,), {"hf_to_vllm_mapper": root_mapper, "packed_modules_mapping": packed})
    Inner = type("Inner", (nn.Module,), {"hf_to_vllm_mapper": inner_mapper})

    def fp8_linear(widths):
        layer = nn.Module()
        codes_N_K = torch.randn(sum(widths), hidden).to(torch.float8_e4m3fn)
        layer.weight, layer.weight_scale, layer.logical_widths = codes_N_K.t(), torch.tensor([0.5]), widths
        return layer

    root, language_model, inner = Root(), nn.Module(), Inner()
    layer0 = nn.Module()
    layer0.linear_attn = nn.Module()
    layer0.linear_attn.in_proj_qkvz = fp8_linear([kd, kd, vd, vd])  # q, k, v | z
    layer0.linear_attn.in_proj_ba = fp8_linear([2, 2])
    layer0.mlp = nn.Module()
    layer0.mlp.gate_up_proj = fp8_linear([5, 5])
    inner.layers = nn.ModuleList([layer0])
    language_model.model = inner
    root.language_model = language_model
    return root


def test_qwen35_names_map_back_to_the_trainers_modules():
    from epirl.engine.naming import NameMap

    names = NameMap(qwen35_like_vllm_model())
    assert names.nests_text_model
    vllm_name = "language_model.model.layers.0.linear_attn.in_proj_qkvz"
    assert names.hf_module(vllm_name) == "model.layers.0.linear_attn.in_proj_qkvz"
    assert names.slices(vllm_name, [4, 4, 6, 6]) == [
        ("model.layers.0.linear_attn.in_proj_qkv", 0), ("model.layers.0.linear_attn.in_proj_qkv", 4),
        ("model.layers.0.linear_attn.in_proj_qkv", 8), ("model.layers.0.linear_attn.in_proj_z", 0)]
    assert names.module_ranges(vllm_name, [4, 4, 6, 6]) == [
        ("model.layers.0.linear_attn.in_proj_qkv", 0, 14), ("model.layers.0.linear_attn.in_proj_z", 14, 6)]
    assert [n for n, _ in names.slices("language_model.model.layers.0.linear_attn.in_proj_ba", [2, 2])] == [
        "model.layers.0.linear_attn.in_proj_b", "model.layers.0.linear_attn.in_proj_a"]
    # vLLM's LoRA loader maps checkpoint spellings: the trainer's keys are re-nested for it
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    assert names.vllm_adapter_key(key) == "base_model.model.model.language_model.layers.0.mlp.down_proj.lora_A.weight"


def test_shared_base_views_split_uneven_fusions_by_module():
    from epirl.engine.plugin import fp8_base_views

    model = qwen35_like_vllm_model()
    views = fp8_base_views(model)
    qkvz = model.language_model.model.layers[0].linear_attn.in_proj_qkvz.weight.t()
    qkv, _ = views["model.layers.0.linear_attn.in_proj_qkv"]
    z, _ = views["model.layers.0.linear_attn.in_proj_z"]
    assert qkv.shape == (14, 8) and z.shape == (6, 8)
    assert qkv.data_ptr() == qkvz.data_ptr() and z.data_ptr() == qkvz[14:].data_ptr()
    assert {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
            "model.layers.0.linear_attn.in_proj_b", "model.layers.0.linear_attn.in_proj_a"} <= set(views)


def test_matched_engine_buffers_take_each_slice_from_its_module():
    """in_proj_qkv's LoRA spans three slices of in_proj_qkvz: A shared, B split by rows. The fused result
    equals running in_proj_qkv and in_proj_z separately with their own adapters."""
    from epirl.engine.naming import NameMap
    from epirl.engine.plugin import _LayerLoRA

    names = NameMap(qwen35_like_vllm_model())
    widths, rank = [4, 4, 6, 6], 3
    state = _LayerLoRA(widths, 8, rank, 2.0, torch.float32, "cpu")
    state.hf_slices = names.slices("language_model.model.layers.0.linear_attn.in_proj_qkvz", widths)
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(rank, 8, generator=g), torch.randn(14, rank, generator=g))
    z = (torch.randn(rank, 8, generator=g), torch.randn(6, rank, generator=g))
    state.load({"model.layers.0.linear_attn.in_proj_qkv": qkv, "model.layers.0.linear_attn.in_proj_z": z})
    x = torch.randn(5, 8, generator=g)
    fused = torch.cat([x @ a.t() @ b.t() for a, b in zip(state.lora_a, state.lora_b)], dim=-1)
    separate = torch.cat([x @ qkv[0].t() @ qkv[1].t(), x @ z[0].t() @ z[1].t()], dim=-1)
    torch.testing.assert_close(fused, separate)


def test_matched_engine_refuses_an_adapter_it_cannot_place():
    """A name that maps nowhere must stop the run, not serve the base model while the trainer trains."""
    from types import SimpleNamespace as NS

    from epirl.engine import plugin
    from epirl.engine.lora_publish import PublishedAdapter

    state = plugin._LayerLoRA([4], 8, 2, 2.0, torch.float32, "cpu")
    state.hf_slices = [("model.layers.0.mlp.down_proj", 0)]
    known = (torch.ones(2, 8), torch.ones(4, 2))
    adapter = PublishedAdapter(NS(lora_int_id=7), {}, 2.0, 1, {"model.layers.0.mlp.down_proj": known,
                                                               "language_model.model.layers.0.mlp.up_proj": known})
    slot = plugin.FusedAdapterSlot([state])
    with pytest.raises(RuntimeError, match=r"no layer for 1 adapter modules.*up_proj"):
        with plugin.active_adapter(slot, adapter):
            pass
    del adapter.modules["language_model.model.layers.0.mlp.up_proj"]
    with plugin.active_adapter(slot, adapter):
        assert torch.equal(state.lora_b[0], known[1]) and slot.loaded == 7


def test_adapter_folders_in_the_text_spelling_are_respelled_for_a_vl_checkpoint(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from epirl.engine.lora_publish import AdapterPublisher
    from epirl.engine.naming import NameMap

    publisher = object.__new__(AdapterPublisher)  # only the naming part; no vLLM behind it
    publisher._names = NameMap(qwen35_like_vllm_model())
    tensors = {"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.ones(2, 3)}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    served = publisher._respelled_copy(str(tmp_path), tensors)
    assert served != str(tmp_path)
    assert list(load_file(f"{served}/adapter_model.safetensors")) == [
        "base_model.model.model.language_model.layers.0.mlp.down_proj.lora_A.weight"]
    nested = {"base_model.model.model.language_model.layers.0.mlp.down_proj.lora_A.weight": torch.ones(2, 3)}
    assert publisher._respelled_copy(str(tmp_path), nested) == str(tmp_path)  # already spelled right
