"""Trainer-side model on the bf16 base: LoRA injection, chunked log-probs, LoRA state dicts, PEFT adapters."""

import json
from types import SimpleNamespace as NS

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from epirl.model import LoRALinear, load_adapter, load_policy, save_adapter
from epirl.model.lora import ALL_PROJECTIONS

ARCHS = ["qwen3", "qwen3_5", "llama"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny matmuls, one thread


def make_cfg(path, base="bf16", rank=4, alpha=8.0, targets=ALL_PROJECTIONS, checkpointing=False, seed=0):
    return NS(model=NS(path=path, dtype="float32"), seed=seed,
              trainer=NS(base=base, gradient_checkpointing=checkpointing, logprob_chunk_tokens=16),
              lora=NS(rank=rank, alpha=alpha, targets=list(targets)))


def randomize_lora_b(policy, seed=1, std=0.05):
    """B starts at zero (PEFT init); give it values so the adapter changes outputs and A gets gradients."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in policy.lora_modules().values():
            module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=generator) * std)


def full_logprobs(policy, input_ids, targets, temperature):
    logits = policy.model(input_ids=input_ids).logits.float() / temperature
    logprobs_all = torch.log_softmax(logits, -1)
    token_lp = logprobs_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    return token_lp, entropy


def batch(vocab=300, B=3, T=21, seed=0):
    ids = torch.randint(0, vocab, (B, T + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_target_projection_is_lora_and_only_lora_trains(tiny_dirs, arch):
    policy = load_policy(make_cfg(tiny_dirs[arch]), "cpu")
    present = {n.rpartition(".")[2] for n, m in policy.model.named_modules() if isinstance(m, LoRALinear)}
    expected = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    if arch == "qwen3_5":
        expected |= {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
    assert present == expected
    assert not any(isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] in ALL_PROJECTIONS
                   for n, m in policy.model.named_modules())
    trainable = {id(p) for p in policy.model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in policy.lora_parameters()}


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_b_adapter_leaves_the_model_unchanged(tiny_dirs, arch):
    """LoRA injection with PEFT's init (B = 0) must compute exactly the checkpoint's function."""
    policy = load_policy(make_cfg(tiny_dirs[arch]), "cpu")
    reference = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32)
    input_ids, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(policy.model(input_ids=input_ids).logits, reference(input_ids=input_ids).logits,
                                   rtol=0, atol=1e-5)


def test_lora_linear_matches_the_formula():
    torch.manual_seed(0)
    W, A, B, x = torch.randn(6, 5), torch.randn(3, 5), torch.randn(6, 3), torch.randn(4, 5)
    layer = LoRALinear(W, None, A, B, lora_scale=0.5)
    torch.testing.assert_close(layer(x), x @ W.T + 0.5 * (x @ A.T) @ B.T)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 4096])
def test_chunked_logprobs_equal_full_logits(tiny_dirs, arch, chunk_tokens):
    policy = load_policy(make_cfg(tiny_dirs[arch]), "cpu")
    randomize_lora_b(policy)
    input_ids, targets = batch()
    with torch.no_grad():
        lp, ent = policy.token_logprobs(input_ids, targets, 0.7, chunk_tokens, with_entropy=True)
        lp_ref, ent_ref = full_logprobs(policy, input_ids, targets, 0.7)
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    assert policy.token_logprobs(input_ids, targets, 0.7, chunk_tokens)[1] is None


@pytest.mark.parametrize("checkpointing", [False, True])
def test_chunked_logprob_gradients_equal_full_logits_gradients(tiny_dirs, checkpointing):
    policy = load_policy(make_cfg(tiny_dirs["qwen3"], checkpointing=checkpointing), "cpu")
    randomize_lora_b(policy)
    input_ids, targets = batch()
    weights = torch.rand(targets.shape, generator=torch.Generator().manual_seed(3))  # a per-token loss weight

    def grads(loss):
        policy.model.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in policy.lora_parameters()]

    lp, ent = policy.token_logprobs(input_ids, targets, 0.9, chunk_tokens=5, with_entropy=True)
    # the entropy is a metric: no autograd graph (its graph kept the [N, V] fp32 log-softmax alive)
    assert not ent.requires_grad and ent.grad_fn is None
    chunked = grads((lp * weights).sum())
    lp_ref, ent_ref = full_logprobs(policy, input_ids, targets, 0.9)
    torch.testing.assert_close(ent, ent_ref.detach(), rtol=1e-5, atol=1e-5)
    full = grads((lp_ref * weights).sum())
    assert all(g.abs().sum() > 0 for g in full)  # every A and B gets a gradient: the test can fail
    for g, g_ref in zip(chunked, full):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)


def test_entropy_saves_nothing_for_backward():
    """Asking for the entropy (a metric) must not make autograd keep [N, V] tensors: the bytes one LM-head chunk
    saves for backward are the same with and without it (with grad, its exp/mul nodes saved fp32 [N, V] tensors,
    which the chunk's checkpoint recomputed and kept alive until the next micro-batch)."""
    from epirl.model.logprobs import _chunk_logprobs

    torch.manual_seed(0)
    N, H, V = 6, 16, 50
    hidden = torch.randn(N, H, requires_grad=True)
    weight, targets = torch.randn(V, H), torch.randint(0, V, (N,))

    def saved_bytes(with_entropy):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, entropy = _chunk_logprobs(hidden, targets, weight, None, 0.9, with_entropy)
        assert not entropy.requires_grad
        return total[0]

    without = saved_bytes(False)
    assert without >= N * V * 4  # the log-softmax output itself is saved: the hook sees the chunk's saves
    assert saved_bytes(True) == without


def test_lora_state_dict_names_shapes_and_roundtrip(tiny_dirs):
    policy = load_policy(make_cfg(tiny_dirs["qwen3"], rank=4), "cpu")
    state = policy.lora_state_dict()
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    q = policy.model.model.layers[0].self_attn.q_proj
    assert state[f"{name}.lora_A.weight"].shape == (4, q.in_features)
    assert state[f"{name}.lora_B.weight"].shape == (q.out_features, 4)
    assert len(state) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    state[f"{name}.lora_A.weight"].add_(1.0)  # clones: editing them must not touch the policy
    assert not torch.equal(state[f"{name}.lora_A.weight"], q.lora_A)
    other = load_policy(make_cfg(tiny_dirs["qwen3"], rank=4, seed=7), "cpu")
    other.load_lora_state_dict(state)
    torch.testing.assert_close(other.model.model.layers[0].self_attn.q_proj.lora_A, q.lora_A + 1.0)
    del state[f"{name}.lora_B.weight"]
    with pytest.raises(KeyError, match="1 missing"):
        other.load_lora_state_dict(state)


def test_lora_init_is_seeded_per_module(tiny_dirs):
    a = load_policy(make_cfg(tiny_dirs["llama"], seed=0), "cpu").lora_state_dict()
    b = load_policy(make_cfg(tiny_dirs["llama"], seed=0), "cpu").lora_state_dict()
    c = load_policy(make_cfg(tiny_dirs["llama"], seed=1), "cpu").lora_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a if k.endswith("lora_A.weight"))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_adapter_files_follow_the_peft_format_and_load_back(tiny_dirs, tmp_path, arch):
    """PEFT's documented on-disk format (peft.utils.save_and_load): adapter_config.json with a LoraConfig's
    fields, adapter_model.safetensors with `base_model.model.<path>.lora_{A,B}.weight`, unscaled."""
    targets = ["q_proj", "v_proj", "in_proj_qkv", "out_proj"]
    policy = load_policy(make_cfg(tiny_dirs[arch], rank=4, alpha=16, targets=targets), "cpu")
    randomize_lora_b(policy)
    save_adapter(policy, tmp_path / "adapter", None)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    present = sorted(targets) if arch == "qwen3_5" else ["q_proj", "v_proj"]  # Qwen3 has no in_proj_*/out_proj
    assert config["r"] == 4 and config["lora_alpha"] == 16 and config["target_modules"] == present
    assert config["base_model_name_or_path"] == tiny_dirs[arch]
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert tensors.keys() == policy.lora_state_dict().keys()
    assert all(k.startswith("base_model.model.model.layers.") for k in tensors)
    fresh = load_policy(make_cfg(tiny_dirs[arch], rank=4, alpha=16, targets=targets, seed=5), "cpu")
    load_adapter(fresh, tmp_path / "adapter")
    input_ids, targets_ids = batch()
    with torch.no_grad():
        torch.testing.assert_close(fresh.token_logprobs(input_ids, targets_ids, 1.0, 32)[0],
                                   policy.token_logprobs(input_ids, targets_ids, 1.0, 32)[0])
    wrong_rank = load_policy(make_cfg(tiny_dirs[arch], rank=8, alpha=16, targets=targets), "cpu")
    with pytest.raises(ValueError, match="lora.rank=8"):
        load_adapter(wrong_rank, tmp_path / "adapter")


def test_peft_loads_the_adapter_and_computes_the_same_logprobs(tiny_dirs, tmp_path):
    peft = pytest.importorskip("peft")  # not installed in the CPU venv; present on the GPU machine
    policy = load_policy(make_cfg(tiny_dirs["qwen3"], rank=4, alpha=8), "cpu")
    randomize_lora_b(policy)
    save_adapter(policy, tmp_path / "adapter", None)
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    input_ids, targets = batch()
    with torch.no_grad():
        logits = peft_model(input_ids=input_ids).logits.float()
        expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(policy.token_logprobs(input_ids, targets, 1.0, 16)[0], expected,
                                   rtol=1e-5, atol=1e-5)


def test_unknown_target_fails_with_the_setting_name(tiny_dirs):
    with pytest.raises(ValueError, match="lora.targets"):
        load_policy(make_cfg(tiny_dirs["qwen3"], targets=["q_proj", "qkv"]), "cpu")


def test_a_few_sgd_steps_reduce_the_loss(tiny_dirs):
    """End to end: logprobs of a fixed batch go up when maximised (the LoRA path is really trained)."""
    policy = load_policy(make_cfg(tiny_dirs["llama"], checkpointing=True), "cpu")
    optimizer = torch.optim.AdamW(policy.lora_parameters(), lr=1e-2)
    input_ids, targets = batch(B=2, T=16)
    losses = []
    for _ in range(5):
        lp, _ = policy.token_logprobs(input_ids, targets, 1.0, 8)
        loss = -lp.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


def test_vllm_reads_the_adapter_files(tiny_dirs, tmp_path):
    """vLLM's own loader (PEFTHelper + LoRAModel.from_local_checkpoint, the path of a LoRARequest) accepts
    the files: every module found, shapes [r, in] / [out, r], scaling alpha / r."""
    lora_model = pytest.importorskip("vllm.lora.lora_model")
    from vllm.lora.peft_helper import PEFTHelper

    policy = load_policy(make_cfg(tiny_dirs["qwen3_5"], rank=4, alpha=8.0), "cpu")
    save_adapter(policy, tmp_path / "adapter", None)
    helper = PEFTHelper.from_local_dir(str(tmp_path / "adapter"), max_position_embeddings=512)
    loaded = lora_model.LoRAModel.from_local_checkpoint(str(tmp_path / "adapter"), set(ALL_PROJECTIONS), helper,
                                                        lora_model_id=1, device="cpu", dtype=torch.float32)
    assert set(loaded.loras) == set(policy.lora_modules())
    state = policy.lora_state_dict()
    for name, lora in loaded.loras.items():
        torch.testing.assert_close(lora.lora_a, state[f"base_model.model.{name}.lora_A.weight"])
        assert lora.lora_b.shape == state[f"base_model.model.{name}.lora_B.weight"].shape  # vLLM may pre-scale B
    assert helper.r == 4 and helper.lora_alpha == 8.0
