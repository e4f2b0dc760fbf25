"""Runner logic (prompting, records, aggregation, paired comparison, outputs) with a scripted engine.

The engine here is a deterministic stand-in so that every verdict is known in advance; the real engine
is exercised end to end in test_eval_e2e.py.
"""

import json
from dataclasses import dataclass

import pytest
import torch
from rich.console import Console

from epirl.eval.benchmarks import Benchmark, EvalProblem
from epirl.eval.runner import EvalSettings, Variant, run_eval
from epirl.rewards import RewardPool


class CharTokenizer:
    """Chat template = "<user>{content}<assistant>" (+ "<think>" when thinking), one id per character."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, enable_thinking=False):
        assert add_generation_prompt and tokenize
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return [ord(c) for c in text + ("<think>" if enable_thinking else "")]


@dataclass
class ScriptedCompletion:
    token_ids: list
    logprobs: list
    text: str
    finish_reason: str


class ScriptedEngine:
    """Answers "What is a+b?" with a+b, plus a per-adapter offset for problems whose a is odd."""

    def __init__(self, offsets):
        self.tokenizer = CharTokenizer()
        self.offsets = offsets  # adapter dir -> error added when a is odd
        self.active = None
        self.calls = []

    def load_adapter_dir(self, path):
        self.active = path

    def generate(self, prompt_ids_P, n, max_tokens, temperature, top_p=1.0, seed=None, use_adapter=True):
        # vLLM in-process samples from torch's generator: record how the runner seeded it
        self.calls.append(dict(prompts=len(prompt_ids_P), n=n, use_adapter=use_adapter, seed=seed,
                               torch_seed=torch.initial_seed()))
        outputs = []
        for ids in prompt_ids_P:
            text = "".join(map(chr, ids))
            assert text.endswith("<assistant>") and "\\boxed{}" in text  # template + instruction
            a, b = map(int, text.split("What is ")[1].split("?")[0].split("+"))
            error = self.offsets.get(self.active, 0) if (use_adapter and a % 2) else 0
            outputs.append([ScriptedCompletion([1] * (s + 1), [0.0] * (s + 1), f"so \\boxed{{{a + b + error}}}", "stop")
                            for s in range(n)])
        return outputs


def arithmetic_benchmark(name, count, start=0):
    problems = [EvalProblem(f"{name}-{i}", f"What is {i}+{start}?", (str(i + start),), name) for i in range(count)]
    return Benchmark(name, "memory", problems, loaded_size=count, published_size=500)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(workers=2, timeout_s=5.0) as shared:
        yield shared


def quiet_console():
    return Console(file=open("/dev/null", "w"), width=200)


def test_two_adapters_records_metrics_and_mcnemar(pool, tmp_path):
    # adapter "a" is wrong on odd i (5 of 10 in bench1, 2 of 4 in bench2); adapter "b" always right
    engine = ScriptedEngine({"dir/a": 1, "dir/b": 0})
    benchmarks = [arithmetic_benchmark("math500", 10), arithmetic_benchmark("minerva", 4, start=2)]
    settings = EvalSettings(samples=1, temperature=0.0, max_tokens=32, batch_prompts=3)
    report = run_eval(engine, pool, benchmarks, settings, [Variant("a", "dir/a"), Variant("b", "dir/b")], tmp_path, quiet_console())

    assert report["variants"]["a"]["benchmarks"]["math500"]["accuracy"] == pytest.approx(0.5)
    assert report["variants"]["a"]["benchmarks"]["minerva"]["accuracy"] == pytest.approx(0.5)
    assert report["variants"]["a"]["pooled"]["accuracy"] == pytest.approx(7 / 14)
    assert report["variants"]["b"]["pooled"]["accuracy"] == 1.0
    pooled = report["comparisons"][0]["pooled"]
    assert (pooled["only_a_correct"], pooled["only_b_correct"]) == (0, 7)
    assert pooled["mcnemar_p"] == pytest.approx(2 / 2**7)
    assert report["benchmarks"]["math500"]["size_matches"] is False
    # batches of 3 prompts: ceil(10/3) + ceil(4/3) calls per adapter, all with the adapter on
    assert len(engine.calls) == 2 * (4 + 2) and all(call["use_adapter"] for call in engine.calls)

    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 28
    wrong = [r for r in records if not r["correct"]]
    assert {(r["variant"], r["problem_id"]) for r in wrong} == {("a", f"math500-{i}") for i in (1, 3, 5, 7, 9)} | {("a", "minerva-1"), ("a", "minerva-3")}
    assert all(r["grade_status"] == "graded" and r["extracted_answer"] is not None for r in records)
    assert json.loads((tmp_path / "eval.json").read_text())["variants"]["b"]["pooled"]["problems"] == 14


def test_samples_give_avg_and_pass_at_k_and_base_has_adapter_off(pool):
    engine = ScriptedEngine({})
    settings = EvalSettings(samples=3, temperature=0.7, max_tokens=16, seed=11)
    report = run_eval(engine, pool, [arithmetic_benchmark("math500", 4)], settings, [Variant("base")], None, quiet_console())
    summary = report["variants"]["base"]["pooled"]
    assert summary["avg@3"] == 1.0 and summary["pass@3"] == 1.0 and summary["ci_method"] == "bootstrap"
    # no per-request seed (vLLM would give every prompt of a call the same one); the process RNG is seeded
    assert engine.calls == [dict(prompts=4, n=3, use_adapter=False, seed=None, torch_seed=11 * 1_000_003)]


def test_prompt_too_long_is_recorded_as_wrong_not_sent(pool):
    engine = ScriptedEngine({})
    benchmark = arithmetic_benchmark("math500", 3)
    long_problem = EvalProblem("long", "What is 1+1?" + " pad" * 100, ("2",), "math500")
    benchmark = Benchmark("math500", "memory", benchmark.problems + [long_problem], 4, 500)
    settings = EvalSettings(max_tokens=8, max_model_len=200)
    report = run_eval(engine, pool, [benchmark], settings, [Variant("base")], None, quiet_console())
    assert report["variants"]["base"]["pooled"]["accuracy"] == pytest.approx(3 / 4)
    assert report["variants"]["base"]["finish_reason"] == {"stop": 3, "prompt_too_long": 1}
    assert engine.calls[0]["prompts"] == 3


def test_settings_validation():
    with pytest.raises(ValueError, match="temperature > 0"):
        EvalSettings(samples=4, temperature=0.0)
    with pytest.raises(ValueError, match="samples"):
        EvalSettings(samples=0)


def test_wandb_gets_summary_and_failure_table_only_with_an_active_run(pool, tmp_path, monkeypatch):
    import wandb

    from epirl.eval.report import log_to_wandb

    engine = ScriptedEngine({"dir/a": 1})
    benchmarks = [arithmetic_benchmark("math500", 4)]
    settings = EvalSettings(max_tokens=8)
    report = run_eval(engine, pool, benchmarks, settings, [Variant("a", "dir/a")], None, quiet_console())
    assert wandb.run is None and log_to_wandb(report, []) is False  # no run: nothing logged, nothing started

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="epirl-test", mode="offline", dir=str(tmp_path))
    try:
        run_eval(engine, pool, benchmarks, settings, [Variant("a", "dir/a")], None, quiet_console())
        assert run.summary["eval/a/math500/accuracy"] == pytest.approx(0.5)
        assert run.summary["eval/a/pooled/ci95_high"] == pytest.approx(report["variants"]["a"]["pooled"]["ci95_high"])
        assert run.summary["eval/failures"]["nrows"] == 2  # problems 1 and 3 are answered wrong
        # inside training: the table goes to the training step, the run summary is not touched
        run.log({"train/x": 1.0}, step=6)
        run_eval(engine, pool, benchmarks, settings, [Variant("b", "dir/a")], None, quiet_console(), wandb_step=7)
        assert run.step == 7 and "eval/b/math500/accuracy" not in run.summary.keys()
    finally:
        run.finish()
