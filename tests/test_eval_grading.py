"""`epirl eval` grading: the `no answer` column, one line saying why no answer could be read, and the
arithmetic training task graded the way the adapter's training run graded it (its config.yaml's reward.style).

A scripted engine answers every prompt with fixed text, so each verdict is known in advance.
"""

import argparse
import io
from dataclasses import dataclass

import pytest
from rich.console import Console

from epirl.config import DataConfig, dump_config, load_config
from epirl.eval.benchmarks import Benchmark, EvalProblem, TrainingTask, load_benchmark
from epirl.eval.runner import EvalSettings, Variant, run_eval
from epirl.eval_cli import add_eval_args, training_config_file, validate_args
from epirl.rewards import RewardPool


class CharTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt, tokenize, enable_thinking=False):
        return [ord(c) for c in "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"]


@dataclass
class Completion:
    token_ids: list
    logprobs: list
    text: str
    finish_reason: str


class AnsweringEngine:
    """Answers "What is a OP b?" with `template.format(value)` (the arithmetic task's prompts, or the math ones)."""

    def __init__(self, template: str, finish_reason: str = "stop"):
        self.tokenizer = CharTokenizer()
        self.template, self.finish_reason = template, finish_reason
        self.prompts: list[str] = []

    def load_adapter_dir(self, path):
        pass

    def generate(self, prompt_ids_P, n, max_tokens, temperature, top_p=1.0, seed=None, use_adapter=True):
        outputs = []
        for ids in prompt_ids_P:
            text = "".join(map(chr, ids))
            self.prompts.append(text)
            a, op, b = text.split("What is ")[1].split("?")[0].split()
            value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            outputs.append([Completion([1, 2], [0.0, 0.0], self.template.format(value), self.finish_reason)] * n)
        return outputs


@pytest.fixture(scope="module")
def pool():
    with RewardPool(workers=1, timeout_s=5.0) as shared:
        yield shared


def math_benchmark(count: int = 3) -> Benchmark:
    problems = [EvalProblem(f"p{i}", f"What is {i} + 1?", (str(i + 1),), "math500") for i in range(count)]
    return Benchmark("math500", "memory", problems, count, 500)


NUMBER_TRAINED = TrainingTask(DataConfig(), seed=0, reward_style="number", config_file="runs/arith/config.yaml")


def evaluate(pool, engine, benchmarks, variants, max_tokens=16):
    output = io.StringIO()
    report = run_eval(engine, pool, benchmarks, EvalSettings(max_tokens=max_tokens), variants, None,
                      Console(file=output, width=250))
    return report, output.getvalue().splitlines()


def test_number_trained_adapter_on_a_boxed_benchmark_says_why_in_one_line(pool):
    engine = AnsweringEngine("{} is the answer.")  # a number, no \boxed{}
    report, lines = evaluate(pool, engine, [math_benchmark()], [Variant("arith", "runs/arith/adapter",
                                                                        training=NUMBER_TRAINED)])
    metrics = report["variants"]["arith"]["benchmarks"]["math500"]
    assert metrics["accuracy"] == 0.0 and metrics["no_answer"] == 3
    assert report["variants"]["arith"]["pooled"]["no_answer"] == 3
    header = next(line for line in lines if "variant" in line and "benchmark" in line)
    assert "no answer" in header
    notes = [line for line in lines if line.startswith("note:")]
    assert notes == ["note: arith on math500: no answer could be read from any of 3 completion(s): math500 is graded by "
                     "the last \\boxed{...}, but arith was trained with reward.style: number (runs/arith/config.yaml); "
                     "evaluate it on its own task with --benchmarks arithmetic"]
    assert report["notes"] == [notes[0].removeprefix("note: ")]


def test_unparseable_without_a_training_config_names_the_format_or_the_token_limit(pool):
    _, lines = evaluate(pool, AnsweringEngine("{} is the answer."), [math_benchmark(2)], [Variant("base")])
    assert [line for line in lines if line.startswith("note:")] == [
        "note: base on math500: no answer could be read from any of 2 completion(s): math500 is graded by the last "
        "\\boxed{...} and no completion has one (see records.jsonl)"]
    _, lines = evaluate(pool, AnsweringEngine("Let me think", "length"), [math_benchmark(2)], [Variant("base")], 7)
    assert [line for line in lines if line.startswith("note:")] == [
        "note: base on math500: no answer could be read from any of 2 completion(s): every completion stopped at the "
        "token limit (7) before an answer"]


def test_some_answers_read_means_no_note(pool):
    engine = AnsweringEngine("\\boxed{{{}}}")
    report, lines = evaluate(pool, engine, [math_benchmark()], [Variant("base")])
    assert report["variants"]["base"]["pooled"]["accuracy"] == 1.0 and report["notes"] == []
    assert not [line for line in lines if line.startswith("note:")]


def test_the_training_task_is_graded_with_the_adapters_reward_style(pool):
    arithmetic = load_benchmark("arithmetic", limit=4, training=NUMBER_TRAINED)
    engine = AnsweringEngine("{} is the answer.")  # how a number-trained adapter answers
    boxed_trained = TrainingTask(DataConfig(), reward_style="boxed")
    report, _ = evaluate(pool, engine, [arithmetic, math_benchmark(2)],
                         [Variant("number", "a", training=NUMBER_TRAINED), Variant("boxed", "b", training=boxed_trained),
                          Variant("base")])
    assert report["variants"]["number"]["benchmarks"]["arithmetic"]["accuracy"] == 1.0  # its last number is read
    assert report["variants"]["number"]["benchmarks"]["math500"]["no_answer"] == 2  # math500 stays \boxed{}
    assert report["variants"]["boxed"]["benchmarks"]["arithmetic"]["no_answer"] == 4  # trained to box: graded so
    assert report["variants"]["base"]["benchmarks"]["arithmetic"]["accuracy"] == 1.0  # the task's own format
    arithmetic_prompts = [p for p in engine.prompts if "Answer with just the number." in p]
    assert len(arithmetic_prompts) == 12 and not any("\\boxed" in p for p in arithmetic_prompts)


def parse(argv):
    parser = argparse.ArgumentParser(prog="epirl")
    add_eval_args(parser.add_subparsers(dest="command"))
    return parser.parse_args(["eval", *argv])


@pytest.mark.parametrize("adapter", ["runs/arith/adapter", "runs/arith/checkpoints/step_000004/adapter"])
def test_eval_reads_the_training_config_beside_the_adapter(tmp_path, monkeypatch, adapter):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["reward.style=number", "seed=3", "data.arithmetic.max_operand=5",
                             "data.arithmetic.num_problems=30", "data.arithmetic.ops=['*']"])
    dump_config(cfg, tmp_path / "runs" / "arith" / "config.yaml")
    (tmp_path / adapter).mkdir(parents=True)
    (tmp_path / adapter / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    assert str(training_config_file(adapter)) == "runs/arith/config.yaml"
    _, benchmarks, variants, _ = validate_args(parse(["--model", "smollm2", "--adapter", adapter,
                                                      "--benchmarks", "arithmetic"]))
    assert variants[0].training.reward_style == "number" and variants[0].training.config_file == "runs/arith/config.yaml"
    task = benchmarks[0]
    assert task.source == "runs/arith/config.yaml" and task.training_task and task.instruction == ""
    assert len(task.problems) <= 30 and all(" * " in p.problem for p in task.problems)
    assert all(int(n) <= 5 for p in task.problems for n in p.problem.split("?")[0].split()[2::2])
