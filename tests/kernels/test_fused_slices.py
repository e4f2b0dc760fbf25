"""One call per fused layer (kernels/w8a16/slices.py, kernels/lora_linear/sliced.py), on the CPU reference:
the trainer's module group gives the engine's fused call bitwise, and the gradients of every slice's adapter."""

import pytest
import torch

from epirl.kernels import Fp8LoRALinear, quantize_weight_fp8, split_fused, w8a16_lora
from epirl.kernels.lora_linear.sliced import attach_slice_group
from epirl.kernels.w8a16.slices import block_views, sliced_lora_operands
from epirl.model.fp8 import Fp8Linear

K, R, SIGMA = 48, 4, 2.0
WIDTHS = [16, 8, 8]  # q, k, v


def ungroup(modules):
    """The modules as `kernels.fused_slices: false` leaves them: no slice group, one call each."""
    for m in modules:
        m.slice_group = None


def _group(lora_slices=(True, True, True), seed=0):
    """q, k, v over one packed codes buffer (one scale), each with a random adapter or none."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(w, K, generator=gen) * 0.1 for w in WIDTHS]
    codes, scale = quantize_weight_fp8(weights)
    members = []
    for width, view, has_lora in zip(WIDTHS, split_fused(codes, WIDTHS), lora_slices):
        if has_lora:
            a = torch.randn(R, K, generator=gen) * 0.2
            b = torch.randn(width, R, generator=gen) * 0.2
            members.append(Fp8LoRALinear(view, scale, torch.nn.Parameter(a), torch.nn.Parameter(b), SIGMA))
        else:
            members.append(Fp8Linear(view, scale))
    return codes, scale, members


def _engine_call(x, codes, scale, members):
    """What the matched engine computes for the fused layer: one w8a16_lora with A_cat / B_bd in x's dtype."""
    a = [m.lora_A.detach() if isinstance(m, Fp8LoRALinear) else None for m in members]
    b = [m.lora_B.detach() if isinstance(m, Fp8LoRALinear) else None for m in members]
    a_cat, b_bd = sliced_lora_operands(a, b, WIDTHS, x.dtype)
    return w8a16_lora(x, codes, scale, a_cat, b_bd, SIGMA)


@pytest.mark.parametrize("lora_slices", [(True, True, True), (True, False, True), (False, False, False)])
def test_group_forward_is_the_engines_fused_call(monkeypatch, lora_slices):
    codes, scale, members = _group(lora_slices)
    attach_slice_group(members)
    x = torch.randn(2, 5, K, dtype=torch.bfloat16)
    outs = [m(x) for m in members]
    want = _engine_call(x.reshape(-1, K), codes, scale, members).reshape(2, 5, -1)
    assert torch.equal(torch.cat(outs, dim=-1), want)
    ungroup(members)  # `kernels.fused_slices` off: each module alone (the per-slice engine call), close to the fused one
    alone = torch.cat([m(x) for m in members], dim=-1)
    torch.testing.assert_close(alone.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_off_diagonal_blocks_are_exact_zeros():
    a = [torch.ones(R, K), None, torch.full((R, K), 2.0)]
    b = [torch.ones(16, R), None, torch.full((8, R), 3.0)]
    a_cat, b_bd = sliced_lora_operands(a, b, WIDTHS, torch.bfloat16)
    assert a_cat.shape == (3 * R, K) and b_bd.shape == (32, 3 * R)
    a_views, b_views = block_views(a_cat, b_bd, WIDTHS, R)
    assert torch.equal(a_views[2], a[2].bfloat16()) and torch.equal(b_views[0], b[0].bfloat16())
    assert not a_views[1].any() and not b_views[1].any()
    assert not b_bd[:16, R:].any() and not b_bd[16:24].any() and not b_bd[24:, :2 * R].any()
    assert sliced_lora_operands([None] * 3, [None] * 3, WIDTHS, torch.bfloat16) == (None, None)


def test_mismatched_adapters_are_refused():
    with pytest.raises(ValueError, match="slice 1 has A"):
        sliced_lora_operands([torch.ones(R, K), torch.ones(R, K)], [torch.ones(16, R), torch.ones(9, R)],
                             [16, 8], torch.bfloat16)
    with pytest.raises(ValueError, match="differ in"):
        sliced_lora_operands([torch.ones(R, K), torch.ones(R + 1, K)], [torch.ones(16, R), torch.ones(8, R + 1)],
                             [16, 8], torch.bfloat16)


def test_group_gradients_match_each_slice_alone(monkeypatch):
    codes, scale, members = _group((True, False, True), seed=1)
    attach_slice_group(members)
    x = torch.randn(7, K, dtype=torch.bfloat16, requires_grad=True)
    gy = [torch.randn(7, w, dtype=torch.bfloat16) for w in WIDTHS]
    grads = {}
    for mode in ("1", "0"):
        if mode == "0":
            ungroup(members)
        x.grad = None
        for m in members:
            for p in m.parameters():
                p.grad = None
        sum((m(x).float() * g.float()).sum() for m, g in zip(members, gy)).backward()
        grads[mode] = [x.grad.clone()] + [p.grad.clone() for m in members for p in m.parameters()]
    assert len(grads["1"]) == 5  # x, A and B of q and v
    for fused, alone in zip(grads["1"], grads["0"]):
        torch.testing.assert_close(fused.float(), alone.float(), rtol=3e-2, atol=3e-2)
    assert members[0].lora_A.grad.dtype == torch.float32 and members[0].lora_A.grad.is_contiguous()


def test_group_runs_once_per_input_and_again_for_a_new_one(monkeypatch):
    codes, scale, members = _group()
    group = attach_slice_group(members)
    calls = []
    run = group._run
    monkeypatch.setattr(group, "_run", lambda x: calls.append(1) or run(x))
    x = torch.randn(3, K, dtype=torch.bfloat16)
    [m(x) for m in members]
    assert len(calls) == 1 and group._pending is None  # all taken: nothing kept
    members[0](x)
    members[0](x)  # taken twice before the others: computed again, same bits
    assert len(calls) == 3
    y = torch.randn(3, K, dtype=torch.bfloat16)
    assert torch.equal(members[1](y), _engine_call(y, codes, scale, members)[:, 16:24])


def test_views_of_separate_buffers_are_refused():
    _, _, members = _group()
    codes2, scale2 = members[1].codes.clone(), members[1].scale
    members[1] = Fp8LoRALinear(codes2, scale2, members[1].lora_A, members[1].lora_B, SIGMA)
    with pytest.raises(ValueError, match="not row views of one buffer"):
        attach_slice_group(members)


def test_engine_layer_with_block_buffers_equals_the_trainer_group(monkeypatch):
    """The matched engine's fused layer (`_LayerLoRA(one_call=True)` + the custom op) == the trainer's group, bitwise."""
    from epirl.engine.plugin import _LayerLoRA, w8a16_lora_slices

    codes, scale, members = _group((True, False, True), seed=2)
    attach_slice_group(members)
    state = _LayerLoRA(WIDTHS, K, R, SIGMA, torch.bfloat16, "cpu", one_call=True)
    for m, a_buf, b_buf in zip(members, state.lora_a, state.lora_b):  # what publishing an adapter copies in place
        if isinstance(m, Fp8LoRALinear):
            a_buf.copy_(m.lora_A.detach())
            b_buf.copy_(m.lora_B.detach())
    x = torch.randn(6, K, dtype=torch.bfloat16)
    engine = w8a16_lora_slices(x, codes, scale, state.lora_a, state.lora_b, WIDTHS, SIGMA, None, state.a_cat,
                               state.b_bd)
    assert torch.equal(engine, torch.cat([m(x) for m in members], dim=-1))
    assert not state.b_bd[16:24].any()  # k has no adapter: its block stays zero
    per_slice = w8a16_lora_slices(x, codes, scale, state.lora_a, state.lora_b, WIDTHS, SIGMA, None)  # today's path
    torch.testing.assert_close(per_slice.float(), engine.float(), rtol=2e-2, atol=2e-2)


def test_one_call_layers_agree_between_engine_and_trainer():
    from epirl.engine.naming import DEFAULT_PACKED
    from epirl.model.loading import ONE_CALL_LAYERS, PACKED_MODULES

    assert ONE_CALL_LAYERS and set(ONE_CALL_LAYERS) <= set(DEFAULT_PACKED)
    assert all(tuple(DEFAULT_PACKED[name]) == PACKED_MODULES[name] for name in ONE_CALL_LAYERS)


def test_random_policy_groups_q_k_v_not_gate_up(monkeypatch):
    from model_fixtures import tiny_config

    from epirl.model import random_policy

    config = tiny_config("qwen3", 64, 1, 0)
    policy = random_policy(config, "fp8", "cpu", 4, 8.0, ["q_proj", "v_proj", "up_proj"], seed=0)
    layer = policy.model.model.layers[0]
    q, k, v = layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj
    assert q.slice_group is k.slice_group is v.slice_group and [q.slice_index, v.slice_index] == [0, 2]
    assert getattr(layer.mlp.gate_proj, "slice_group", None) is None  # not in ONE_CALL_LAYERS (measured slower)
    assert getattr(layer.self_attn.o_proj, "slice_group", None) is None
    ids = torch.randint(0, 64, (2, 9))
    logprobs, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], 1.0, 64)
    logprobs.sum().backward()
    assert q.lora_A.grad is not None and v.lora_B.grad is not None and layer.mlp.up_proj.lora_A.grad is not None
    ungroup([q, k, v])  # the same policy, one call per module: close, not the same bits
    policy.model.zero_grad(set_to_none=True)
    alone, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], 1.0, 64)
    torch.testing.assert_close(alone, logprobs.detach(), rtol=0.05, atol=0.05)


def test_gradient_checkpointing_recomputes_through_the_group(monkeypatch):
    """Under non-reentrant checkpointing (the trainer's default) the recomputed forward runs the group again; the
    gradients are those without checkpointing, and no group keeps outputs after the step."""
    from model_fixtures import tiny_config

    from epirl.model import random_policy

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    grads = []
    for checkpointing in (False, True):
        policy = random_policy(tiny_config("qwen3", 64, 1, 0), "fp8", "cpu", 4, 8.0, ["q_proj", "k_proj", "up_proj"],
                               seed=0, gradient_checkpointing=checkpointing)
        logprobs, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], 1.0, 64)
        logprobs.sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
        groups = {id(m.slice_group): m.slice_group for m in policy.model.modules() if hasattr(m, "slice_group")}
        assert groups and all(g._pending is None for g in groups.values())
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("change", ["fused_adamw", "foreach_adamw", "in_place", "data_swap", "replaced"])
def test_the_group_computes_with_the_adapter_as_it_is_now(monkeypatch, change):
    """Every way a trainer changes an adapter reaches the next fused call. A fused AdamW step (the trainer's optimizer
    on CUDA) and a `param.data` swap (the probe's previous adapter) leave the parameters' `_version` where it was: a
    cache keyed on it served the first step's q, k, v adapter for a whole run."""
    codes, scale, members = _group(seed=4)
    attach_slice_group(members)
    x = torch.randn(3, K, dtype=torch.bfloat16)
    before = torch.cat([m(x) for m in members], dim=-1)
    params = [p for m in members for p in (m.lora_A, m.lora_B)]
    if change.endswith("adamw"):
        optimizer = torch.optim.AdamW(params, lr=0.5, fused=change == "fused_adamw" or None,
                                      foreach=change == "foreach_adamw" or None)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
    elif change == "in_place":
        with torch.no_grad():
            members[2].lora_B.add_(1.0)
    elif change == "data_swap":
        members[2].lora_B.data = members[2].lora_B.detach() + 1.0
    else:
        members[2].lora_B = torch.nn.Parameter(members[2].lora_B.detach() + 1.0)
    after = torch.cat([m(x) for m in members], dim=-1)
    assert torch.equal(after, _engine_call(x, codes, scale, members))
    assert not torch.equal(after[:, 24:], before[:, 24:])


def test_qwen3_5_groups_attention_but_not_mlp_or_the_gated_deltanet(monkeypatch):
    """Qwen3.5: q / k / v of the full-attention layer are grouped, gate / up are not; the gated DeltaNet's
    in_proj_qkv / in_proj_z (four engine slices in two modules) stay one call per module, as the engine keeps them."""
    pytest.importorskip("transformers.models.qwen3_5")
    from model_fixtures import tiny_config

    from epirl.model import random_policy

    policy = random_policy(tiny_config("qwen3_5", 64, 1, 0), "fp8", "cpu", 4, 8.0,
                           ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_qkv", "in_proj_z"], seed=0)
    grouped = {n.rsplit(".", 1)[-1] for n, m in policy.model.named_modules() if getattr(m, "slice_group", None)}
    assert grouped == {"q_proj", "k_proj", "v_proj"}, grouped
    ids = torch.randint(0, 64, (1, 7))
    logprobs, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], 1.0, 64)
    logprobs.sum().backward()
    assert all(p.grad is not None for p in policy.lora_parameters())
