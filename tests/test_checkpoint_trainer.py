"""Trainer step and checkpoints on a tiny random Qwen3: micro-batching invariance, exact round trip."""

import pytest
import torch

from epirl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from epirl.config import load_config
from epirl.rl.trainer import build_batch, build_optimizer, train_step


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from model_fixtures import write_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny_qwen3")
    write_tiny_checkpoint("qwen3", out, seed=0)
    return str(out)


def _cfg(tiny_dir, tmp_path, *extra):
    return load_config(None, [f"model.path={tiny_dir}", "model.dtype=float32", "lora.rank=4", "lora.alpha=8",
                              "trainer.lr=1e-2", f"output_dir={tmp_path}", "rl.correction=tis", *extra])


def _batch():
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(6):
        prompt = torch.randint(3, 300, (5 + i,), generator=g).tolist()
        completion = torch.randint(3, 300, (3 + 2 * i,), generator=g).tolist()
        engine_lp = (-torch.rand(len(completion), generator=g) * 3).tolist()
        seqs.append((prompt, completion, engine_lp, float(i % 3) - 1.0))
    return build_batch(seqs, pad_id=0)


def test_build_batch_aligns_targets_and_engine_logprobs():
    batch = build_batch([([1, 2, 3], [4, 5], [-0.1, -0.2], 1.0), ([7], [8, 9, 10], [-1.0, -2.0, -3.0], -1.0)], pad_id=0)
    assert batch.input_ids_B_T.tolist() == [[1, 2, 3, 4], [7, 8, 9, 0]]
    assert batch.targets_B_T.tolist() == [[2, 3, 4, 5], [8, 9, 10, 0]]
    assert batch.mask_B_T.tolist() == [[False, False, True, True], [True, True, True, False]]
    assert batch.engine_logprobs_B_T[1, :3].tolist() == [-1.0, -2.0, -3.0]


def _step(cfg, micro):
    from epirl.model import load_policy

    cfg.trainer.micro_batch_size = micro
    policy = load_policy(cfg, "cpu")
    with torch.no_grad():  # non-zero B so that the step's gradient reaches A too
        for p in policy.lora_parameters():
            p.add_(torch.randn_like(p) * 0.01)
    optimizer, scheduler = build_optimizer(policy.lora_parameters(), cfg)
    metrics = train_step(policy, optimizer, scheduler, _batch(), cfg, "cpu")
    return policy, optimizer, scheduler, metrics


def test_micro_batching_does_not_change_the_step(tiny_dir, tmp_path):
    torch.manual_seed(0)
    one, _, _, m1 = _step(_cfg(tiny_dir, tmp_path), micro=6)
    torch.manual_seed(0)
    many, _, _, m3 = _step(_cfg(tiny_dir, tmp_path), micro=2)
    assert m1["loss/pg"] == pytest.approx(m3["loss/pg"], rel=1e-4, abs=1e-6)
    assert m1["train/grad_norm"] == pytest.approx(m3["train/grad_norm"], rel=1e-4)
    a, b = one.lora_state_dict(), many.lora_state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)
    assert 0.0 <= m1["is/clipped_frac"] <= 1.0 and m1["mismatch/k3_kl"] > 0.0


def test_checkpoint_round_trip_is_exact(tiny_dir, tmp_path):
    from epirl.model import load_policy

    cfg = _cfg(tiny_dir, tmp_path)
    torch.manual_seed(0)
    policy, optimizer, scheduler, _ = _step(cfg, micro=3)
    run = tmp_path / "run"
    for step in (1, 2, 3):
        save_checkpoint(run, step, policy=policy, cfg=cfg, optimizer=optimizer, scheduler=scheduler,
                        data_state={"cursor": 10 * step}, keep_last=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    (run / "checkpoints" / "step_000004.tmp").mkdir()  # a crashed save is never picked
    latest = latest_checkpoint(run)
    assert latest.name == "step_000003"
    expected_rng = torch.rand(3)

    fresh = load_policy(cfg, "cpu")
    opt2, sched2 = build_optimizer(fresh.lora_parameters(), cfg)
    state = load_checkpoint(latest, policy=fresh, optimizer=opt2, scheduler=sched2)
    assert state["step"] == 3 and state["data"] == {"cursor": 30}
    for key, value in policy.lora_state_dict().items():
        assert torch.equal(value, fresh.lora_state_dict()[key]), key
    assert torch.equal(torch.rand(3), expected_rng), "RNG state restored to the save point"
    s1, s2 = optimizer.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)


def test_ppo_epochs_take_several_clipped_steps_against_a_fixed_pi_old(tiny_dir, tmp_path):
    """rl.ppo_epochs=3: three optimizer steps per batch; π_old is scored once before the first, so later
    epochs see ratios ≠ 1 (clip-higher acts) while the first equals the one-epoch step exactly."""
    torch.manual_seed(0)
    _, _, s1, m1 = _step(_cfg(tiny_dir, tmp_path, "rl.ppo_epochs=1", "rl.clip_high=0.001", "rl.clip_low=0.001"), 3)
    torch.manual_seed(0)
    _, opt3, s3, m3 = _step(_cfg(tiny_dir, tmp_path, "rl.ppo_epochs=3", "rl.clip_high=0.001", "rl.clip_low=0.001"), 3)
    assert s1.last_epoch == 1 and s3.last_epoch == 3 and m3["train/epochs"] == 3.0
    assert m1["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m1["loss/clip_frac_high"] == 0.0
    assert abs(m3["loss/ratio_mean"] - 1.0) > 1e-4
    assert m3["loss/clip_frac_low"] + m3["loss/clip_frac_high"] > 0.0


def test_kl_penalty_pulls_towards_the_base_model(tiny_dir, tmp_path):
    """rl.kl_coef > 0: the reference is the base model (adapter off); the k3 KL is logged and adds a gradient."""
    torch.manual_seed(0)
    policy, _, _, m0 = _step(_cfg(tiny_dir, tmp_path), 3)
    torch.manual_seed(0)
    policy_kl, _, _, m1 = _step(_cfg(tiny_dir, tmp_path, "rl.kl_coef=10.0"), 3)
    assert m0["loss/kl_ref"] == 0.0 and m1["loss/kl_ref"] > 0.0
    assert m1["train/grad_norm"] != pytest.approx(m0["train/grad_norm"], rel=1e-6)
    # the context manager restores the adapter: scales are back to alpha / r
    assert all(m.lora_scale == pytest.approx(2.0) for m in policy_kl.lora_modules().values())


def test_sequence_level_clip_fraction_does_not_depend_on_micro_batching(tiny_dir, tmp_path):
    extra = ("rl.correction=seq-tis", "rl.tis_cap=1e-10")  # short sequences exceed it, long ones do not
    torch.manual_seed(0)
    *_, whole = _step(_cfg(tiny_dir, tmp_path, *extra), 6)
    torch.manual_seed(0)
    *_, split = _step(_cfg(tiny_dir, tmp_path, *extra), 4)  # micro-batches of 4 and 2 sequences
    assert 0.0 < whole["is/clipped_frac"] < 1.0
    assert split["is/clipped_frac"] == pytest.approx(whole["is/clipped_frac"], abs=1e-6)
