"""epirl.engine.serving_lora without an engine (CPU): the no-adapter branch of the op (vLLM's base path, decided by
vLLM's no-LoRA flag or, without it, the token map), the live token map read in the op body (not the length
torch.compile baked at trace time), the tokens sorted by adapter before the vendor GEMM's expand, the timed
dispatch timed at most once per shape and never during a CUDA-graph capture, and the compile-cache key of the mode
(`additional_config`) in epirl's engine arguments and in the plugin's check."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from epirl.engine import serving_lora


class _Method:
    """A base layer's quantization method: records its calls, returns a fresh tensor like vLLM's apply."""

    def __init__(self, n_out):
        self.n_out, self.calls = n_out, 0

    def apply(self, layer, x, bias=None):
        self.calls += 1
        return x[..., :1].repeat_interleave(self.n_out, dim=-1) * 2 + (0 if bias is None else bias)


# a layer_parts() result: codes [N=4, K=8], one slice with 1 adapter slot of rank 2
ONE_SLICE = (torch.zeros(4, 8), None, [torch.zeros(1, 2, 8)], [torch.zeros(1, 4, 2)], [4])

def _fake_layer(n_out, token_map, flag=None):
    """What the op body reads of a vLLM LoRA layer: base_layer.quant_method, punica_wrapper's token map (and the
    GPU wrapper's kernel metadata with its no-LoRA flag, when `flag` is given)."""
    punica = SimpleNamespace(token_lora_indices=token_map)
    if flag is not None:
        punica.token_mapping_meta = SimpleNamespace(no_lora_flag_cpu=torch.tensor([flag]),
                                                    token_indices_sorted_by_lora_ids=torch.arange(64))
    return SimpleNamespace(base_layer=SimpleNamespace(quant_method=_Method(n_out)), punica_wrapper=punica)


@pytest.mark.parametrize("flag", [None, True])
def test_no_adapter_batch_is_vllms_base_path(flag):
    """All tokens -1 (CPU wrapper: decided from the map) or vLLM's no-LoRA flag set (GPU wrapper): the op returns
    the base layer's quantization-method output unchanged and counts a vendor call."""
    x = torch.randn(5, 8)
    layer = _fake_layer(12, torch.full((5,), -1, dtype=torch.long), flag)
    key = serving_lora.register_layer(layer)
    before = serving_lora.stats()["vendor_calls"]
    out = torch.ops.epirl.w8a8_multi_lora_layer(x, torch.zeros(0, dtype=torch.long), None, None, key, 12)
    assert torch.equal(out, _Method(12).apply(None, x))
    assert layer.base_layer.quant_method.calls == 1
    assert serving_lora.stats()["vendor_calls"] == before + 1


def test_adapter_batches_do_not_take_the_base_path():
    """The no-LoRA flag False wins over a map that looks empty; a CPU map with one adapter token is not empty."""
    from epirl.engine.serving_lora import _no_adapter

    x = torch.randn(4, 8)
    empty = torch.full((4,), -1, dtype=torch.long)
    assert not _no_adapter(_fake_layer(3, empty, flag=False), empty, 4, x)
    one = torch.tensor([-1, -1, 0, -1])
    assert not _no_adapter(_fake_layer(3, one), one, 4, x)
    assert _no_adapter(_fake_layer(3, one), one, 2, x)  # only the batch's own rows count
    assert _no_adapter(_fake_layer(3, one[:0]), one[:0], 4, x)  # no map at all: no token has an adapter


def test_op_reads_the_live_token_map_not_the_traced_argument(monkeypatch):
    """torch.compile bakes the token map's length (a Python int in vLLM's punica wrapper) into the graph: the op
    body reads the layer's current map, so a batch longer than the traced length keeps its adapters."""
    seen = {}

    def fake_serve(x, codes, scale, lora_a, lora_b, widths, token_lora, order, bias, choice=None, segs=None):
        seen.update(ids=token_lora.clone(), order=order)
        return x.new_zeros(*x.shape[:-1], codes.shape[0])

    live = torch.tensor([0, 1, 0, 1, 0, 1])
    layer = _fake_layer(4, live, flag=False)
    monkeypatch.setattr(serving_lora, "layer_parts", lambda lyr: ONE_SLICE)
    monkeypatch.setattr(serving_lora, "serve_slices", fake_serve)
    key = serving_lora.register_layer(layer)
    stale = live[:2]  # what a graph traced on a 2-token batch passes
    torch.ops.epirl.w8a8_multi_lora_layer(torch.randn(6, 8), stale, None, None, key, 4)
    assert torch.equal(seen["ids"], live)
    assert seen["order"] is not None  # vLLM's sorted order: eager, and it covers exactly this batch
    assert serving_lora.stats()["short_maps"] >= 0


def test_vendor_expand_sorts_tokens_by_adapter_when_vllm_gives_no_order():
    pytest.importorskip("triton")
    from epirl.kernels.w8a8_multi.triton import expand_order

    for n in (24, 256):  # K2's expand tile: 16 tokens up to 32 tokens, 128 beyond
        ids = torch.tensor([3, 0, 2, 0, 1, 3, -1, 2] * 32)[:n]
        order = expand_order(ids)
        assert order is not None and sorted(order.tolist()) == list(range(n))
        assert torch.all(ids[order][1:] >= ids[order][:-1])
    assert expand_order(torch.zeros(16, dtype=torch.long)) is None  # one tile holds them all
    assert expand_order(torch.zeros(100, dtype=torch.long)) is None


def test_timed_dispatch_times_a_shape_once_and_never_during_capture(monkeypatch):
    from epirl.kernels.w8a8_multi import dispatch

    timed, capturing = [], [True]

    def fake_time(shape, vllm_from=None):
        timed.append(shape)
        best = {b: "fused" if b <= 16 else "vendor+epirl" for b in dispatch.BUCKETS}
        return dispatch.DispatchTable({f"{shape.name}@{b}": dict(times_us={}, best=v) for b, v in best.items()},
                                      dispatch.BUCKETS)

    monkeypatch.setattr(serving_lora, "_time_shape", fake_time)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(serving_lora, "_TABLES", {})
    cuda = torch.device("cuda")
    assert serving_lora._choice(64, 96, 8, 200, cuda, mode="timed") == "fused"  # inside a capture: fused, not timed
    assert timed == []
    capturing[0] = False
    choices = [serving_lora._choice(64, 96, 8, M, cuda, mode="timed") for M in (1, 200, 5000, 16384, 3, 300)]
    capturing[0] = True
    choices.append(serving_lora._choice(64, 96, 8, 20000, cuda, mode="timed"))  # beyond the table: its last bucket
    assert serving_lora._choice(64, 96, 8, 200, cuda, mode="fused") == "fused"  # outside timed mode: no table
    assert len(timed) == 1 and choices == ["fused", "vendor+epirl", "vendor+epirl", "vendor+epirl", "fused",
                                           "vendor+epirl", "vendor+epirl"]


def test_compile_key_warning_once_per_engine_config(monkeypatch, caplog):
    from epirl.engine.spec import EngineSpec

    monkeypatch.setattr(serving_lora, "_CHECKED_CONFIGS", [])
    with caplog.at_level(logging.WARNING, logger=serving_lora.__name__):
        good, missing = {"epirl_serving_kernels": "timed"}, {"other": 1}
        assert serving_lora.check_compile_key("timed", good)  # a plain `vllm serve`'s entry
        assert serving_lora.check_compile_key("timed", EngineSpec(serving_kernels="timed").additional_config())
        assert not serving_lora.check_compile_key("timed", missing)
        assert serving_lora.check_compile_key("timed", missing)  # warned once for this engine config
        assert not serving_lora.check_compile_key("timed", {"epirl_serving_kernels": "fused"})
        assert not serving_lora.check_compile_key("timed", EngineSpec(serving_kernels="fused").additional_config())
    assert sum("additional_config lacks" in r.message for r in caplog.records) == 3


def test_layers_take_their_settings_from_the_engine_spec(monkeypatch):
    """A LoRA layer registered while vLLM builds the model keeps the engine spec's mode and threshold; without a spec
    (a plain `vllm serve`), the environment's mode and no threshold; given settings replace them."""
    from epirl.engine import spec

    monkeypatch.setattr(spec, "current", lambda: spec.EngineSpec(serving_kernels="fused", serving_vllm_from=64))
    layer = _fake_layer(4, torch.zeros(3, dtype=torch.long))
    serving_lora.register_layer(layer)
    assert (serving_lora.layer_mode(layer), layer._epirl_vllm_from) == ("fused", 64)
    monkeypatch.setattr(spec, "current", lambda: None)
    monkeypatch.setenv(serving_lora.ENV, "timed")
    plain = _fake_layer(4, torch.zeros(3, dtype=torch.long))
    serving_lora.register_layer(plain)
    assert (serving_lora.layer_mode(plain), plain._epirl_vllm_from) == ("timed", None)
    serving_lora.register_layer(plain, "off")
    assert serving_lora.layer_mode(plain) == "off"


def test_epirl_engine_arguments_key_the_compile_cache_by_the_mode(monkeypatch, tmp_path):
    """Every setting the engine's layers read goes to vLLM in one spec in `additional_config` (hashed into the key of
    vLLM's compile cache): serving mode (engine.serving_kernels; `env`: EPIRL_SERVING_KERNELS), LoRA rank and alpha,
    fused slices, the vLLM-path threshold."""
    pytest.importorskip("vllm")
    from epirl.config import EpirlConfig
    from epirl.engine.engine import llm_kwargs
    from epirl.engine.spec import EngineSpec

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))

    def spec(setting, precision="w8a8", **kernels):
        monkeypatch.setenv(serving_lora.ENV, setting)
        cfg = EpirlConfig.model_validate({"model": {"path": str(tmp_path)}, "kernels": kernels,
                                          "engine": {"precision": precision, "serving_kernels": "env"}})
        return EngineSpec.from_additional_config(llm_kwargs(cfg, str(tmp_path), None)["additional_config"])

    assert spec("0").serving_kernels == "off"
    assert spec("timed").serving_kernels == "timed" and spec("fused").serving_kernels == "fused"
    both = spec("1", precision="w8a16")
    assert both.serving_kernels == "timed" and both.lora_rank > 0 and both.lora_alpha > 0
    assert spec("fused", serving_vllm_from=64).serving_vllm_from == 64
    # the matched engine's fused slices change its qkv op's arguments: a graph compiled with them on must not be
    # replayed with them off (and the reverse)
    fused, per_slice = spec("0", "w8a16"), spec("0", "w8a16", fused_slices=False)
    assert fused.fused_slices is True and per_slice.fused_slices is False
    assert fused.additional_config() != per_slice.additional_config()


def test_batches_from_the_vllm_threshold_run_vllms_own_lora_path(monkeypatch):
    """A layer's vLLM-path threshold N (`kernels.serving_vllm_from`): a batch of at least N tokens with adapters is
    computed by vLLM's own LoRA path (the layer's unwrapped `_apply_sync`) inside the op; smaller batches keep epirl's
    kernels."""
    from epirl.config import load_config

    assert load_config(None, []).kernels.serving_vllm_from is serving_lora.TIMED_VLLM_FROM is None  # never
    layer = _fake_layer(4, torch.zeros(16, dtype=torch.long), flag=False)
    layer._apply_sync = lambda x, bias: x[..., :4] * 3
    served = []
    monkeypatch.setattr(serving_lora, "layer_parts", lambda lyr: ONE_SLICE)
    monkeypatch.setattr(serving_lora, "serve_slices", lambda x, *a: served.append(x.shape[0]) or x[..., :4] * 0)
    key = serving_lora.register_layer(layer, "fused", vllm_from=8)
    before = serving_lora.stats()["vllm_calls"]
    big = torch.randn(16, 8)
    assert torch.equal(torch.ops.epirl.w8a8_multi_lora_layer(big, big[:0, 0].long(), None, None, key, 4),
                       big[..., :4] * 3)
    layer.punica_wrapper.token_lora_indices = torch.zeros(4, dtype=torch.long)
    torch.ops.epirl.w8a8_multi_lora_layer(torch.randn(4, 8), big[:0, 0].long(), None, None, key, 4)
    assert served == [4] and serving_lora.stats()["vllm_calls"] == before + 1


def test_serving_kernels_never_specialize_on_the_token_count():
    """Prefill chunks bring a new token count almost every step: no Triton kernel on the serving path may compile
    per M (a constexpr or a specialized integer M would recompile, seconds each, mid-serving)."""
    pytest.importorskip("triton")
    from epirl.kernels.fp8_quant import triton as quant
    from epirl.kernels.w8a8_multi import triton as k

    for kernel in (k._multi_lora_gemm_kernel, k._quant_shrink_kernel):
        params = {p.name: p for p in kernel.params}
        assert params["M"].do_not_specialize and not params["M"].is_constexpr
    assert "M" not in {p.name for p in quant._per_token_kernel.params}  # one program per token: M is the grid
