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
    from epirl.kernels.w8a8_multi_lora.triton import expand_order

    for n in (24, 256):  # K2's expand tile: 16 tokens up to 32 tokens, 128 beyond
        ids = torch.tensor([3, 0, 2, 0, 1, 3, -1, 2] * 32)[:n]
        order = expand_order(ids)
        assert order is not None and sorted(order.tolist()) == list(range(n))
        assert torch.all(ids[order][1:] >= ids[order][:-1])
    assert expand_order(torch.zeros(16, dtype=torch.long)) is None  # one tile holds them all
    assert expand_order(torch.zeros(100, dtype=torch.long)) is None


def test_timed_dispatch_times_a_shape_once_and_never_during_capture(monkeypatch):
    from epirl.kernels.w8a8_multi_lora import dispatch

    timed, capturing = [], [True]

    def fake_time(shape):
        timed.append(shape)
        best = {b: "fused" if b <= 16 else "vendor+epirl" for b in dispatch.BUCKETS}
        return dispatch.DispatchTable({f"{shape.name}@{b}": dict(times_us={}, best=v) for b, v in best.items()},
                                      dispatch.BUCKETS)

    monkeypatch.setattr(serving_lora, "_time_shape", fake_time)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setitem(serving_lora._STATE, "tables", {})
    serving_lora.set_mode("timed")
    try:
        cuda = torch.device("cuda")
        assert serving_lora._choice(64, 96, 8, 200, cuda) == "fused"  # inside a capture: fused, nothing timed
        assert timed == []
        capturing[0] = False
        choices = [serving_lora._choice(64, 96, 8, M, cuda) for M in (1, 200, 5000, 16384, 3, 300)]
        capturing[0] = True
        choices.append(serving_lora._choice(64, 96, 8, 20000, cuda))  # a bucket beyond the table: its last one
    finally:
        serving_lora.set_mode("off")
    assert len(timed) == 1 and choices == ["fused", "vendor+epirl", "vendor+epirl", "vendor+epirl", "fused",
                                           "vendor+epirl", "vendor+epirl"]


def test_compile_key_warning_once_per_engine_config(monkeypatch, caplog):
    monkeypatch.setitem(serving_lora._STATE, "checked_configs", [])
    serving_lora.set_mode("timed")
    try:
        with caplog.at_level(logging.WARNING, logger=serving_lora.__name__):
            good, missing = {"epirl_serving_kernels": "timed"}, {"other": 1}
            assert serving_lora.check_compile_key(good)
            assert not serving_lora.check_compile_key(missing)
            assert serving_lora.check_compile_key(missing)  # warned once for this engine config
            assert not serving_lora.check_compile_key({"epirl_serving_kernels": "fused"})
    finally:
        serving_lora.set_mode("off")
    assert sum("additional_config lacks" in r.message for r in caplog.records) == 2


def test_epirl_engine_arguments_key_the_compile_cache_by_the_mode(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    from epirl.config import EpirlConfig
    from epirl.engine.engine import _llm_kwargs

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    monkeypatch.setitem(serving_lora._STATE, "installed", False)

    def extra(setting, precision="w8a8"):
        monkeypatch.setenv(serving_lora.ENV, setting)
        cfg = EpirlConfig.model_validate({"model": {"path": str(tmp_path)}, "engine": {"precision": precision}})
        return _llm_kwargs(cfg, str(tmp_path), None).get("additional_config", {})

    assert "epirl_serving_kernels" not in extra("0")
    assert extra("timed")["epirl_serving_kernels"] == "timed" and extra("fused")["epirl_serving_kernels"] == "fused"
    both = extra("1", precision="w8a16")
    assert both["epirl_serving_kernels"] == "timed" and "epirl_w8a16_lora" in both
    # the matched engine's fused slices change its qkv op's arguments: a graph compiled with them on must not be
    # replayed with them off (and the reverse)
    from epirl.kernels.w8a16_lora.slices import SLICES_ENV

    monkeypatch.setenv(SLICES_ENV, "1")
    fused = extra("0", precision="w8a16")["epirl_w8a16_lora"]
    monkeypatch.setenv(SLICES_ENV, "0")
    per_slice = extra("0", precision="w8a16")["epirl_w8a16_lora"]
    assert fused["fused_slices"] is True and per_slice["fused_slices"] is False


def test_batches_from_the_vllm_threshold_run_vllms_own_lora_path(monkeypatch):
    """EPIRL_SERVING_VLLM_FROM=N: a batch of at least N tokens with adapters is computed by vLLM's own LoRA path
    (the layer's unwrapped `_apply_sync`) inside the op; smaller batches keep epirl's kernels."""
    monkeypatch.setenv(serving_lora.VLLM_FROM_ENV, "8")
    assert serving_lora.read_vllm_from() == 8 and serving_lora.read_vllm_from("fused") == 8
    for value, want in (("0", None), ("never", None), (" Never ", None)):
        monkeypatch.setenv(serving_lora.VLLM_FROM_ENV, value)
        assert serving_lora.read_vllm_from() is want
    monkeypatch.setenv(serving_lora.VLLM_FROM_ENV, "")  # unset: timed mode lets the dispatch decide every size
    assert serving_lora.read_vllm_from("timed") is serving_lora.TIMED_VLLM_FROM is None
    assert serving_lora.read_vllm_from("fused") is None  # fused: always epirl's kernels
    monkeypatch.setenv(serving_lora.VLLM_FROM_ENV, "many")
    with pytest.raises(ValueError, match="EPIRL_SERVING_VLLM_FROM='many'"):
        serving_lora.read_vllm_from()

    layer = _fake_layer(4, torch.zeros(16, dtype=torch.long), flag=False)
    layer._apply_sync = lambda x, bias: x[..., :4] * 3
    served = []
    monkeypatch.setattr(serving_lora, "layer_parts", lambda lyr: ONE_SLICE)
    monkeypatch.setattr(serving_lora, "serve_slices", lambda x, *a: served.append(x.shape[0]) or x[..., :4] * 0)
    key = serving_lora.register_layer(layer)
    before = serving_lora.stats()["vllm_calls"]
    serving_lora.set_vllm_from(8)
    try:
        big = torch.randn(16, 8)
        assert torch.equal(torch.ops.epirl.w8a8_multi_lora_layer(big, big[:0, 0].long(), None, None, key, 4),
                           big[..., :4] * 3)
        layer.punica_wrapper.token_lora_indices = torch.zeros(4, dtype=torch.long)
        torch.ops.epirl.w8a8_multi_lora_layer(torch.randn(4, 8), big[:0, 0].long(), None, None, key, 4)
    finally:
        serving_lora.set_vllm_from(None)
    assert served == [4] and serving_lora.stats()["vllm_calls"] == before + 1


def test_serving_kernels_never_specialize_on_the_token_count():
    """Prefill chunks bring a new token count almost every step: no Triton kernel on the serving path may compile
    per M (a constexpr or a specialized integer M would recompile, seconds each, mid-serving)."""
    pytest.importorskip("triton")
    from epirl.kernels.fp8_quant import triton as quant
    from epirl.kernels.w8a8_multi_lora import triton as k

    for kernel in (k._multi_lora_gemm_kernel, k._quant_shrink_kernel):
        params = {p.name: p for p in kernel.params}
        assert params["M"].do_not_specialize and not params["M"].is_constexpr
    assert "M" not in {p.name for p in quant._per_token_kernel.params}  # one program per token: M is the grid
