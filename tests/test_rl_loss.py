"""DAPO loss, importance-sampling corrections and group advantages against hand-computed values."""

import math

import pytest
import torch

from epirl.rl import aggregate, dapo_loss, group_advantages, importance_weights, informative_groups


def test_group_advantages_std_and_mean_only():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = group_advantages(rewards, std_normalize=True)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6)
    assert torch.allclose(adv[0], expected, atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4)), "equal rewards carry no signal"
    centred = group_advantages(rewards, std_normalize=False)
    assert torch.allclose(centred[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_group_advantages_rejects_bad_shape():
    with pytest.raises(ValueError, match="samples>=2"):
        group_advantages(torch.ones(3, 1))


def test_informative_groups():
    rewards = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-0.5, 1.0]])
    assert informative_groups(rewards).tolist() == [False, True, False, True]


def test_dapo_loss_hand_computed_clip_higher():
    # Two sequences × 3 tokens; last token of sequence 1 is padding.
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.5, 0.8], [0.25, 0.5, 0.9]]))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = dapo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # ratios: seq0 = [2, 1, 0.625] with A=+1 → min(ρA, clip(ρ)A) = [1.28, 1, 0.625]
    #         seq1 = [2, 1] with A=-1 → min(-2, -1.28) = -2, min(-1, -1) = -1
    per_token = [-1.28, -1.0, -0.625, 2.0, 1.0]
    assert loss.item() == pytest.approx(sum(per_token) / 5, abs=1e-6)
    assert m["loss/clip_frac_high"] == pytest.approx(1 / 5)  # seq0 token0: ρ>1.28 with A>0
    assert m["loss/clip_frac_low"] == pytest.approx(0.0)     # seq0 token2: ρ<0.8 but A>0 → not clipped


def test_dapo_loss_gradient_is_advantage_weighted_on_policy():
    logp = torch.log(torch.tensor([[0.3, 0.6]])).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = dapo_loss(logp, logp.detach(), torch.tensor([2.0]), mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # On-policy ρ = 1: d/dlogp of −ρA / N = −A / N per token.
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0]]))


def test_aggregations():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "token-mean", total_tokens=8).item() == pytest.approx(10 / 8)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError):
        aggregate(loss, mask, "median")


def test_kl_penalty_adds_k3():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, m = dapo_loss(logp, logp, torch.tensor([0.0]), mask, clip_low=0.2, clip_high=0.2,
                        ref_logprobs_B_T=ref, kl_coef=0.5)
    k3 = 0.5 - 1 - math.log(0.5)  # r − 1 − log r with r = π_ref/π = 0.5
    assert m["loss/kl_ref"] == pytest.approx(k3, abs=1e-6)
    assert loss.item() == pytest.approx(0.5 * k3, abs=1e-6)


def test_tis_truncates_and_counts():
    old = torch.log(torch.tensor([[0.9, 0.5, 0.1]]))
    eng = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))     # ratios 3, 1, 0.5
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, m = importance_weights(old, eng, mask, "tis", cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.5]]), atol=1e-6)
    assert m["is/clipped_frac"] == pytest.approx(1 / 3)
    w_mis, _ = importance_weights(old, eng, mask, "mis", cap=2.0)
    assert torch.allclose(w_mis, torch.tensor([[0.0, 1.0, 0.5]]), atol=1e-6)
    w_none, m_none = importance_weights(old, eng, mask, "none", cap=2.0)
    assert torch.equal(w_none, torch.ones(1, 3)) and m_none["is/clipped_frac"] == 0.0
    # k3 estimate of KL(engine‖trainer): mean of r − 1 − log r with r = π_old/π_eng
    expected = sum(r - 1 - math.log(r) for r in (3.0, 1.0, 0.5)) / 3
    assert m["mismatch/k3_kl"] == pytest.approx(expected, rel=1e-5)


def test_sequence_level_corrections():
    old = torch.log(torch.tensor([[0.9, 0.9], [0.5, 0.5]]))
    eng = torch.log(torch.tensor([[0.3, 0.9], [0.5, 0.5]]))  # sequence ratios 3 and 1
    mask = torch.tensor([[True, True], [True, False]])
    w, m = importance_weights(old, eng, mask, "seq-tis", cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 2.0], [1.0, 0.0]]))
    assert m["is/clipped_frac"] == pytest.approx(0.5)
    w, _ = importance_weights(old, eng, mask, "seq-mis", cap=2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 0.0], [1.0, 0.0]]))
    with pytest.raises(ValueError, match="unknown correction"):
        importance_weights(old, eng, mask, "ppo", cap=2.0)


def test_is_weights_scale_the_policy_gradient():
    logp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    weights = torch.tensor([[2.0, 0.0]])
    loss, _ = dapo_loss(logp, logp.detach(), torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.2,
                        is_weights_B_T=weights)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, 0.0]]))


def test_dynamic_sampling_filters_on_accuracy_not_on_the_overlong_penalty():
    from epirl.rl.loop import Group, informative

    def group(correct, penalty):
        correct_G = torch.tensor(correct, dtype=torch.float32)
        return Group(prompt=None, completions=[], correct_G=correct_G, rewards_G=correct_G + torch.tensor(penalty))

    all_wrong_one_long = group([0, 0, 0, 0], [0, 0, 0, -0.0156])  # spread only from the length penalty
    mixed = group([0, 1, 0, 0], [0, 0, 0, 0])
    all_right = group([1, 1, 1, 1], [0, 0, -0.5, 0])
    assert informative([all_wrong_one_long, mixed, all_right]) == [False, True, False]


def test_bitwise_frac_counts_tokens_whose_log_probs_share_every_bit():
    engine_B_T = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.25, -3.0, -1.0, -1.0]])
    old_B_T = engine_B_T.clone()
    old_B_T[0, 1] = torch.nextafter(torch.tensor(-0.5), torch.tensor(0.0))  # one ulp off: not bitwise
    old_B_T[0, 3] = -0.0  # equal as numbers, not as bits
    old_B_T[1, 3] = -7.0  # a padded position: ignored
    mask_B_T = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    _, metrics = importance_weights(old_B_T, engine_B_T, mask_B_T, "none", 2.0)
    assert metrics["mismatch/bitwise_frac"] == pytest.approx(5 / 7) and metrics["mismatch/unequal_tokens"] == 2.0
    _, same = importance_weights(engine_B_T, engine_B_T, mask_B_T, "tis", 2.0)
    assert same["mismatch/bitwise_frac"] == 1.0 and same["mismatch/k3_kl"] == 0.0
    assert same["mismatch/unequal_tokens"] == 0.0
