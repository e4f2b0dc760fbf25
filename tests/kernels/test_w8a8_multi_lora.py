"""w8a8_multi_lora reference (CPU): vs a naive per-adapter loop of w8a8_lora, mixed batch == groups alone
bitwise, argument errors; and the timed-dispatch logic with an injected timer (cache, buckets, failures)."""

import json

import pytest
import torch

from epirl.kernels import quantize_weight_fp8, w8a8_lora, w8a8_multi_lora
from epirl.kernels.w8a8_multi import dispatch

IDS = [0, 1, -1, 2, 3, 0, -1, 3, 1, 2, 2, 0, 3, -1, 1, 0, 2]


def problem(M=17, K=96, N=40, L=4, r=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    codes, scale = quantize_weight_fp8(torch.randn(N, K, generator=g) * 0.05)
    a = (torch.randn(L, r, K, generator=g) * 0.1).bfloat16()
    b = (torch.randn(L, N, r, generator=g) * 0.1).bfloat16()
    return x, codes, scale, a, b, torch.tensor(IDS[:M])


def test_equals_naive_per_adapter_loop_of_w8a8_lora():
    x, codes, scale, a, b, ids = problem()
    sigma = torch.tensor([0.5, 1.0, 2.0, 4.0])
    bias = torch.randn(40).bfloat16()
    got = w8a8_multi_lora(x, codes, scale, a, b, ids, sigma, bias, backend="reference")
    for adapter in (-1, 0, 1, 2, 3):
        rows = ids == adapter
        want = (w8a8_lora(x[rows], codes, scale, bias=bias) if adapter < 0 else
                w8a8_lora(x[rows], codes, scale, a[adapter], b[adapter], float(sigma[adapter]), bias))
        assert torch.equal(got[rows], want), adapter


def test_mixed_batch_equals_each_group_alone_bitwise():
    x, codes, scale, a, b, ids = problem(seed=1)
    mixed = w8a8_multi_lora(x, codes, scale, a, b, ids, 2.0, backend="reference")
    for adapter in (-1, 0, 1, 2, 3):
        rows = (ids == adapter).nonzero().reshape(-1)
        alone = w8a8_multi_lora(x[rows], codes, scale, a, b, ids[rows], 2.0, backend="reference")
        assert torch.equal(alone, mixed[rows])
    assert not torch.equal(mixed[ids == 0], w8a8_multi_lora(x, codes, scale, a, b, torch.full_like(ids, -1), 2.0,
                                                            backend="reference")[ids == 0])


@pytest.mark.parametrize("change,message", [
    (dict(token_lora=torch.zeros(3, dtype=torch.int64)), "token_lora"),
    (dict(token_lora=torch.full((17,), 4)), "token_lora entries"),
    (dict(lora_a=torch.zeros(4, 8, 95)), "LoRA shapes"),
    (dict(lora_b=torch.zeros(40, 8)), "lora_a must be"),
    (dict(lora_scale=torch.ones(3)), "lora_scale"),
])
def test_bad_arguments_name_the_argument(change, message):
    x, codes, scale, a, b, ids = problem()
    args = dict(x=x, codes=codes, scale=scale, lora_a=a, lora_b=b, token_lora=ids, lora_scale=1.0)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        w8a8_multi_lora(**args, backend="reference")


# ---- timed dispatch (pure logic, injected timer) ------------------------------------------------------

SHAPES = [dispatch.Shape("qkv_proj", 4096, 6144, 64), dispatch.Shape("o_proj", 4096, 4096, 64)]
COST = {"fused": lambda M: 10 + M, "vendor+epirl": lambda M: 12 + M / 8, "vendor+vllm": lambda M: 20.0}


def candidates_for(calls):
    def make(shape, M):
        calls.append((shape.name, M))
        return {name: (lambda name=name, M=M: COST[name](M)) for name in COST}
    return make


def timer(fn):
    return fn()  # the candidate returns its "time": what a CUDA-graph timer would measure


def test_dispatch_keeps_fastest_per_bucket_and_caches(tmp_path):
    calls = []
    buckets = (1, 16, 256)
    table = dispatch.load_or_time(tmp_path, "H200", "0.26.0", SHAPES, candidates_for(calls), timer, list(COST),
                                  buckets)
    assert table.best("qkv_proj", 1) == "fused"          # 11 < 12.1 < 20
    assert table.best("qkv_proj", 9) == "vendor+epirl"   # bucket 16: 26 > 14
    assert table.best("o_proj", 5000) == "vendor+vllm"   # beyond the last bucket: 256's entry (266, 44, 20)
    assert len(calls) == 6
    again = dispatch.load_or_time(tmp_path, "H200", "0.26.0", SHAPES, candidates_for(calls), timer, list(COST),
                                  buckets)
    assert len(calls) == 6 and again.entries == table.entries  # restart: read from disk, nothing re-timed
    dispatch.load_or_time(tmp_path, "H100", "0.26.0", SHAPES, candidates_for(calls), timer, list(COST), buckets)
    assert len(calls) == 12  # another GPU is another key
    assert "| qkv_proj | 16 |" in table.markdown()


def test_dispatch_skips_failing_candidate_and_retimes_torn_cache(tmp_path):
    def make(shape, M):
        def broken():
            raise RuntimeError("out of shared memory")
        return {"fused": broken, "vendor+epirl": lambda: 3.0}

    table = dispatch.load_or_time(tmp_path, "H200", "x", SHAPES[:1], make, timer, ["fused", "vendor+epirl"], (1,))
    assert table.best("qkv_proj", 1) == "vendor+epirl"
    (cached,) = tmp_path.glob("*.json")
    cached.write_text("{torn")
    table = dispatch.load_or_time(tmp_path, "H200", "x", SHAPES[:1], make, timer, ["fused", "vendor+epirl"], (1,))
    assert json.loads(cached.read_text())["entries"] == table.entries
    with pytest.raises(KeyError, match="no entry for shape 'down_proj'"):
        table.best("down_proj", 1)


def test_dispatch_all_candidates_failing_is_an_error(tmp_path):
    def make(shape, M):
        return {"fused": lambda: 1 / 0}

    with pytest.raises(RuntimeError, match="every candidate failed on qkv_proj"):
        dispatch.load_or_time(tmp_path, "H200", "x", SHAPES[:1], make, timer, ["fused"], (1,))


def test_buckets_handed_to_vllm_are_not_timed(monkeypatch):
    """Batches from the vLLM-path threshold (`kernels.serving_vllm_from`) on take vLLM's path before the dispatch is asked: the engine times only
    the buckets below it (the 32-4096-token ones were most of the timing at engine start)."""
    from epirl.engine import serving_lora

    assert dispatch.timed_buckets(None) == dispatch.BUCKETS
    assert dispatch.timed_buckets(17) == (1, 4, 8, 16)
    assert dispatch.timed_buckets(100) == (1, 4, 8, 16, 32, 64, 256)  # 99 tokens fall in the 256 bucket
    assert dispatch.timed_buckets(1) == (1,)
    seen = []
    monkeypatch.setattr(dispatch, "load_or_time", lambda *args: seen.append(args[-1]) or "table")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "H200")
    import epirl.kernels.gpu_timing as gpu_timing
    monkeypatch.setattr(gpu_timing, "release", lambda: None)
    assert serving_lora._time_shape(dispatch.Shape("4096x6144", 4096, 6144, 64), 17) == "table"
    assert seen == [(1, 4, 8, 16)]


# ---- the serving setting (epirl.engine.serving_lora) --------------------------------------------------

def test_serving_setting_values(monkeypatch):
    from epirl.engine import serving_lora

    for value, want in (("0", "off"), ("fused", "fused"), ("1", "timed"), ("Timed", "timed")):
        monkeypatch.setenv(serving_lora.ENV, value)
        assert serving_lora.read_mode() == want
    monkeypatch.delenv(serving_lora.ENV)
    assert serving_lora.read_mode() == "off"
    monkeypatch.setenv(serving_lora.ENV, "yes")
    with pytest.raises(ValueError, match="EPIRL_SERVING_KERNELS='yes'"):
        serving_lora.read_mode()
    from epirl.engine.spec import EngineSpec
    with pytest.raises(ValueError, match="expected one of"):
        EngineSpec(serving_kernels="on")


def test_timed_dispatch_that_fails_serves_fused_and_reports_it(monkeypatch):
    """A timing failure at engine start (e.g. inside vLLM's profile run) must not stop the engine."""
    from epirl.engine import serving_lora

    def broken(shape, vllm_from=None):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(serving_lora, "_time_shape", broken)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(serving_lora, "_TABLES", {})
    assert serving_lora._choice(64, 96, 8, 5, torch.device("cuda"), mode="timed") == "fused"
    assert serving_lora._choice(64, 96, 8, 300, torch.device("cuda"), mode="timed") == "fused"  # cached, not re-timed
    tables = serving_lora.dispatch_tables()
    entry = tables["entries"]["64x96@8"]
    assert entry["best"] == "fused" and "capture failed" in entry["failed"]


def test_serving_op_on_vllm_shaped_slot_buffers_equals_per_slice_reference():
    """The op's body on CPU: vLLM's [max_loras, 1, rows, cols] slot buffers, a token map longer than the batch
    (vLLM's persistent buffer), slices q/k/v -> per-slice w8a8_multi_lora, bitwise."""
    import epirl.engine.serving_lora as serving_lora

    g = torch.Generator().manual_seed(0)
    K, widths, L, r, M = 64, [32, 16, 16], 3, 8, 7
    codes, scale = quantize_weight_fp8(torch.randn(sum(widths), K, generator=g) * 0.05)
    a = [(torch.randn(L, 1, r, K, generator=g) * 0.1).bfloat16() for _ in widths]
    b = [(torch.randn(L, 1, w, r, generator=g) * 0.1).bfloat16() for w in widths]
    x = torch.randn(M, K, generator=g).bfloat16()
    token_map = torch.tensor([0, 2, -1, 1, 0, 2, -1, 1, 1])
    bias = torch.randn(sum(widths), generator=g).bfloat16()
    out = serving_lora.serve_slices(x, codes, scale, serving_lora.slot_views(a), serving_lora.slot_views(b), widths,
                                    token_map, None, bias)
    start = 0
    for w, a_s, b_s in zip(widths, a, b):
        rows = slice(start, start + w)
        want = w8a8_multi_lora(x, codes[rows], scale, a_s[:, 0], b_s[:, 0], token_map[:M], 1.0, bias[rows],
                               backend="reference")
        assert torch.equal(out[:, rows], want)
        start += w


def test_slices_reject_buffers_the_kernels_cannot_read():
    pytest.importorskip("triton")
    from epirl.kernels.w8a8_multi.triton import Slices

    a = [torch.zeros(2, 8, 64, dtype=torch.bfloat16) for _ in range(2)]
    b = [torch.zeros(2, 32, 8, dtype=torch.bfloat16), torch.zeros(2, 16, 8, dtype=torch.bfloat16)]
    assert Slices(a, b, [32, 16]).widths == [32, 16]
    with pytest.raises(ValueError, match="lora_b slice 1"):
        Slices(a, b, [32, 32])
    with pytest.raises(ValueError, match="lora_a slice 1"):
        Slices([a[0], torch.zeros(2, 8, 64, dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)], b,
               [32, 16])
    with pytest.raises(ValueError, match="2 A, 1 B slices"):
        Slices(a, b[:1], [32, 16])


def test_timed_dispatch_spreads_tokens_over_the_slots_and_routes_vllm_choices(monkeypatch):
    """The dispatch times batches spread over min(slots, M) adapters (part of the cache key), with vLLM's own
    kernels as the "vllm" candidate; a layer whose table says "vllm" runs vLLM's whole LoRA path inside the op, the
    others reach serve_slices with the dispatch's choice."""
    from epirl.engine import serving_lora
    from epirl.engine.vllm_compat import punica
    from epirl.kernels.w8a8_multi.timing import spread_adapters

    assert dispatch.Shape("q", 64, 96, 8).tag() == "q:64x96r8"
    assert dispatch.Shape("q", 64, 96, 8, adapters=32).tag() == "q:64x96r8a32"
    assert dispatch.cache_key("H200", "x", [dispatch.Shape("q", 64, 96, 8)], (1,), ["fused"]) != \
        dispatch.cache_key("H200", "x", [dispatch.Shape("q", 64, 96, 8, adapters=32)], (1,), ["fused"])
    ids = spread_adapters(256, 32)
    assert sorted(torch.bincount(ids).tolist()) == [8] * 32 and not torch.equal(ids, ids.sort().values)
    assert spread_adapters(4, 32).tolist().count(0) == 1 and spread_adapters(5, 1).eq(0).all()

    seen = {}
    monkeypatch.setattr(dispatch, "load_or_time", lambda *args: seen.update(shape=args[3][0], names=args[6]) or "t")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "H200")
    import epirl.kernels.gpu_timing as gpu_timing
    monkeypatch.setattr(gpu_timing, "release", lambda: None)
    serving_lora._time_shape(dispatch.Shape("64x96", 64, 96, 8, adapters=4))
    assert seen["names"] == ["fused", "fused[bt64]", "fused[bt32]", "vendor+epirl", "vendor+seg", "vendor+seg[bt16]",
                             "vendor+seg[bn64]", "vllm"]
    assert seen["shape"].adapters == 4

    layer, x = object(), torch.randn(5, 64)
    key = len(serving_lora._LAYERS)
    monkeypatch.setattr(serving_lora, "_LAYERS", serving_lora._LAYERS + [layer])
    monkeypatch.setattr(punica, "token_slots", lambda lay: (torch.zeros(5, dtype=torch.long), None))
    monkeypatch.setattr(serving_lora, "_no_adapter", lambda *a: False)
    parts = (torch.zeros(96, 64), torch.ones(1), [torch.zeros(4, 8, 64)], [torch.zeros(4, 96, 8)], [96])
    monkeypatch.setattr(serving_lora, "layer_parts", lambda lay: parts)
    asked = []
    monkeypatch.setattr(serving_lora, "_choice",
                        lambda K, N, r, M, dev, slots, mode, vllm_from: asked.append(slots) or choice)
    monkeypatch.setattr(punica, "vllm_lora_apply", lambda lay, xx, bias: torch.full((5, 96), 7.0))
    served = []  # (choice, segments) reaching serve_slices
    monkeypatch.setattr(serving_lora, "serve_slices", lambda *a: served.append(a[9:]) or torch.full((5, 96), 1.0))
    monkeypatch.setattr(punica, "token_segments", lambda lay: "vLLM's metadata")
    calls = serving_lora._STATS["vllm_calls"]
    choice = "vllm"
    assert serving_lora.w8a8_multi_lora_layer(x, torch.zeros(5, dtype=torch.long), None, None, key, 96).eq(7).all()
    assert serving_lora._STATS["vllm_calls"] == calls + 1 and asked == [4]
    for choice in ("vendor+epirl", "vendor+seg", "vendor+seg[bt16]"):
        assert serving_lora.w8a8_multi_lora_layer(x, torch.zeros(5, dtype=torch.long), None, None, key, 96).eq(1).all()
    # the segment-tiled paths read vLLM's per-step segment metadata; the others need none
    meta = "vLLM's metadata"
    assert served == [("vendor+epirl", None), ("vendor+seg", meta), ("vendor+seg[bt16]", meta)]
    # a token map longer than the batch: vLLM's segments would name tokens past x, so serve_slices builds its own
    monkeypatch.setattr(punica, "token_slots", lambda lay: (torch.zeros(7, dtype=torch.long), None))
    serving_lora.w8a8_multi_lora_layer(x, torch.zeros(5, dtype=torch.long), None, None, key, 96)
    assert served[-1] == ("vendor+seg[bt16]", None)


def test_serve_slices_runs_the_chosen_k2_tile(monkeypatch):
    """A "fused[<tag>]" choice runs the prefill path with PREFILL_VARIANTS[tag] (CUDA inputs only; faked here)."""
    from epirl.engine import serving_lora
    from epirl.kernels.w8a8_multi import segmented
    from epirl.kernels.w8a8_multi import triton as multi
    seen = {}
    monkeypatch.setattr(serving_lora, "w8a8_multi_lora_slices", lambda *a, **kw: seen.update(kw) or a[0].new_zeros(5, 96))

    class CudaLike(torch.Tensor):  # serve_slices takes its CPU reference branch for CPU tensors
        is_cuda = True

    x = torch.zeros(5, 64).as_subclass(CudaLike)
    parts = (torch.zeros(96, 64), torch.ones(1), [torch.zeros(4, 8, 64)], [torch.zeros(4, 96, 8)], [96])
    serving_lora.serve_slices(x, *parts, torch.zeros(5, dtype=torch.long), None, None, choice="fused[bt32]")
    assert seen["path"] == "prefill" and seen["config"] == multi.PREFILL_VARIANTS["bt32"]
    # "vendor+seg[<tag>]": the vendor GEMM, then the segment-tiled kernels with SEG_VARIANTS[tag]'s expand tile, on
    # the given segments (vLLM's metadata) or, without them, on segments built from the token map
    monkeypatch.setattr(serving_lora, "_vendor_base", lambda x2, *a: x2.new_zeros(5, 96))
    monkeypatch.setattr(serving_lora, "expand_segments", lambda y, x2, a, b, segs, sigma, **kw: seen.update(
        kw, segs=segs) or y)
    serving_lora.serve_slices(x, *parts, torch.zeros(5, dtype=torch.long), None, None, choice="vendor+seg[bn64]",
                              segs="vLLM's")
    assert seen["config"] == segmented.SEG_VARIANTS["bn64"] and seen["segs"] == "vLLM's"
    ids = torch.tensor([2, -1, 0, 2, 3])
    serving_lora.serve_slices(x, *parts, ids, None, None, choice="vendor+seg")
    assert seen["config"] is None and seen["segs"].counts.tolist() == [1, 1, 0, 2, 1]
