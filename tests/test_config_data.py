"""Config errors (one line naming the field or file), overrides, and prompt sources."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from epirl.config import ConfigError, EpirlConfig, describe_fields, dump_config, load_config
from epirl.data import DataError, PromptStream, arithmetic_problems, deduplicate, load_problems
from epirl.config import DataConfig

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_validates(recipe):
    cfg = load_config(recipe)
    assert cfg.name == recipe.stem


def test_main_recipe_has_the_papers_settings():
    cfg = load_config(RECIPES / "qwen35_9b_dapo.yaml")
    assert cfg.model.path == "Qwen/Qwen3.5-9B" and cfg.data.format == "dapo"
    assert (cfg.rl.steps, cfg.rl.prompts_per_step, cfg.rl.samples_per_prompt, cfg.rl.max_tokens) == (200, 16, 8, 2048)
    assert (cfg.lora.rank, cfg.rl.clip_low, cfg.rl.clip_high, cfg.rl.tis_cap) == (64, 0.2, 0.28, 2.0)
    assert cfg.engine.precision == "w8a8" and cfg.rl.correction == "tis"


def test_overrides_parse_yaml_values():
    cfg = load_config(None, ["rl.steps=7", "lora.targets=[q_proj, v_proj]", "engine.kv_release=false",
                             "model.tokenizer=null", "name=my-run"])
    assert cfg.rl.steps == 7 and cfg.lora.targets == ["q_proj", "v_proj"]
    assert cfg.engine.kv_release is False and cfg.model.tokenizer is None and cfg.name == "my-run"


@pytest.mark.parametrize("override, message", [
    (["rl.stepz=3"], "override rl.stepz=3: unknown key 'rl.stepz' (did you mean 'rl.steps'?)"),
    (["rl.clip_low=3"], "override rl.clip_low=3: Input should be less than or equal to 1"),
    (["engine.precision=fp4"], "override engine.precision=fp4: Input should be 'bf16', 'w8a8' or 'w8a16'"),
    (["lora.targets=[]"], "override lora.targets=[]: must name at least one module"),
    (["rl.steps"], "not of the form key.sub=value"),
    (["rl.steps.x=1"], "override rl.steps.x=1: rl.steps: Input should be a valid integer"),
    (["rl.steps=3", "rl.stepz=4"], "override rl.stepz=4: unknown key"),
    (["engine.serving_kernels=timed"], "engine.serving_kernels=timed serves W8A8 layers, but engine.precision=bf16"),
    (["engine.serving_kernels=on"], "Input should be 'env', 'auto', 'off', 'fused' or 'timed'"),
])
def test_bad_overrides_fail_with_one_line_naming_the_field(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_recipe_files(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("rl:\n  steps: [1,\n")
    with pytest.raises(ConfigError, match="broken.yaml.*not valid YAML"):
        load_config(broken)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("trainer:\n  learning_rate: 1e-4\n")
    with pytest.raises(ConfigError, match="unknown.yaml: unknown key 'trainer.learning_rate'"):
        load_config(unknown)
    typo = tmp_path / "typo.yaml"
    typo.write_text("rl:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"^\S*typo.yaml: unknown key 'rl.temprature' \(did you mean 'rl.temperature'\?\)$"):
        load_config(typo)
    # the recipe's own bad value is the recipe's; an override's is the override's
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl:\n  clip_low: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: rl.clip_low: Input should be less than or equal to 1 \(got 3\)"):
        load_config(bad, ["rl.steps=2"])
    with pytest.raises(ConfigError, match=r"^override rl.clip_low=5: "):
        load_config(bad, ["rl.clip_low=5"])


def test_cli_bad_recipe_exits_2_without_creating_a_run(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"output_dir: {tmp_path / 'runs'}\nrl:\n  temperature: -1\n")
    proc = subprocess.run([sys.executable, "-m", "epirl.cli", "train", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "rl.temperature" in proc.stderr
    assert not (tmp_path / "runs").exists(), "a bad recipe must not create a run folder"


def test_resolved_config_roundtrips(tmp_path):
    cfg = load_config(RECIPES / "smollm2_arith_cpu.yaml", ["rl.steps=3"])
    dump_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


def test_every_field_is_documented():
    undocumented = [key for key, _, doc in describe_fields() if not doc]
    assert undocumented == []


def test_arithmetic_is_seeded_and_correct():
    a = arithmetic_problems(50, 9, ["+", "-", "*"], seed=3, instruction="")
    b = arithmetic_problems(50, 9, ["+", "-", "*"], seed=3, instruction="")
    assert a == b
    for p in a:
        expr = p.messages[0]["content"].removeprefix("What is ").rstrip("?").strip()
        assert str(eval(expr)) == p.ground_truth


def test_dapo_schema_and_dedup(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"Q{i % 3}"}], "reward_model": {"ground_truth": str(i % 3)},
             "extra_info": {"index": i}} for i in range(30)]
    path = tmp_path / "dapo.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    problems = load_problems(DataConfig(source=str(path)), seed=0)
    assert [p.ground_truth for p in problems] == ["0", "1", "2"]  # 30 rows, 3 unique prompts
    assert problems[1].messages == [{"role": "user", "content": "Q1"}]


def test_parquet_math_schema_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "math.parquet"
    pq.write_table(pa.table({"problem": ["1+1?", "2+2?"], "answer": ["2", "4"]}), path)
    problems = load_problems(DataConfig(source=str(path)), seed=0)
    assert problems[0].ground_truth == "2" and "\\boxed{}" in problems[0].messages[0]["content"]
    with pytest.raises(DataError, match="data.source: no such file"):
        load_problems(DataConfig(source=str(tmp_path / "nope.jsonl")), seed=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no schema"}\n')
    with pytest.raises(DataError, match="cannot detect the data format"):
        load_problems(DataConfig(source=str(bad)), seed=0)


class _Tokenizer:
    """Character-level chat template: enough to test ordering and length filtering."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, enable_thinking):
        return [ord(c) for c in messages[-1]["content"]]


def test_prompt_stream_is_seeded_resumable_and_filters_long_prompts():
    problems = arithmetic_problems(20, 9, ["+"], seed=0, instruction="")
    stream = PromptStream(problems, _Tokenizer(), seed=1, shuffle=True, thinking=False, max_prompt_tokens=100)
    first = [p.problem.uid for p in stream.take(7)]
    state = stream.state_dict()
    rest = [p.problem.uid for p in stream.take(30)]  # crosses an epoch boundary
    again = PromptStream(problems, _Tokenizer(), seed=1, shuffle=True, thinking=False, max_prompt_tokens=100)
    again.load_state_dict(state)
    assert [p.problem.uid for p in again.take(30)] == rest
    assert len(set(first + rest[:13])) == 20, "an epoch visits every problem once"
    short = PromptStream(problems, _Tokenizer(), seed=1, shuffle=True, thinking=False, max_prompt_tokens=3)
    with pytest.raises(DataError, match="max_prompt_tokens"):
        short.take(1)
    # Half the prompts too long and a step that needs more prompts than the data holds: still served.
    mixed = problems[:5] + [replace(q, messages=[{"role": "user", "content": "x" * 200}]) for q in problems[5:10]]
    stream = PromptStream(mixed, _Tokenizer(), seed=1, shuffle=True, thinking=False, max_prompt_tokens=100)
    served = stream.take(16)
    assert len(served) == 16 and stream.skipped_too_long >= 10


def test_deduplicate_keeps_first():
    problems = arithmetic_problems(200, 2, ["+"], seed=0, instruction="")
    unique = deduplicate(problems)
    assert len(unique) == 9 and unique[0] == problems[0]


def test_in_training_eval_loads_local_benchmarks(tmp_path):
    from epirl.rl.hooks import PeriodicEval

    path = tmp_path / "math500.jsonl"
    path.write_text("\n".join(json.dumps({"problem": f"{i}+1?", "answer": str(i + 1), "unique_id": f"p{i}"})
                              for i in range(10)))
    cfg = load_config(None, ["rl.eval_every=5", f"rl.eval_benchmarks=[math500={path}]", "rl.eval_limit=4"])
    hook = PeriodicEval(cfg, tmp_path)
    assert [len(b.problems) for b in hook.benchmarks] == [4]
    assert hook.due(5) and hook.due(10) and not hook.due(3)
    off = PeriodicEval(load_config(None, []), tmp_path)
    assert off.benchmarks is None and not off.due(5)


@pytest.mark.parametrize("override, message", [
    ("engine.vllm_args.not_a_vllm_arg=1", "engine.vllm_args.not_a_vllm_arg: not an argument of vLLM"),
    ("model.path=/nonexistent/model", "model.path: /nonexistent/model: no such folder"),
    ("data.source=/nonexistent/data.jsonl", "data.source: no such file: /nonexistent/data.jsonl"),
])
def test_cli_bad_inputs_found_at_start_exit_2_with_one_line(tmp_path, override, message):
    """Inputs only checkable once read (model folder, data file, vLLM's own argument names): still one line,
    before any engine starts."""
    recipe = RECIPES / "smollm2_arith_cpu.yaml"
    proc = subprocess.run([sys.executable, "-m", "epirl.cli", "train", str(recipe), f"output_dir={tmp_path}",
                           "tracking.wandb=disabled", override],
                          capture_output=True, text=True, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-2000:]
    assert message in output and "Traceback" not in output
    assert "Initializing a V1 LLM engine" not in output  # found before the engine, not after it loaded


def test_cli_resume_without_a_checkpoint_exits_2(tmp_path):
    (tmp_path / "run").mkdir()
    dump_config(load_config(None, []), tmp_path / "run" / "config.yaml")  # a run that crashed before step 1
    proc = subprocess.run([sys.executable, "-m", "epirl.cli", "train", "--resume", str(tmp_path / "run")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_unknown_lora_target_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"^override lora\.targets=\[q_proj, q_projx\]: unknown projection\(s\) \['q_projx'\]; known: "):
        load_config(None, ["lora.targets=[q_proj, q_projx]"])


def test_responses_must_leave_room_for_a_prompt_and_prompts_are_capped_by_the_context():
    with pytest.raises(ConfigError, match=r"^override rl\.max_tokens=512: rl\.max_tokens=512 leaves no room for a "
                                          r"prompt in model\.max_model_len=512"):
        load_config(None, ["model.max_model_len=512", "rl.max_tokens=512"])
    cfg = load_config(None, ["model.max_model_len=512", "rl.max_tokens=32", "data.max_prompt_tokens=1024"])
    assert cfg.prompt_token_limit == 480


def test_a_shared_base_needs_an_fp8_engine_refused_before_anything_loads():
    with pytest.raises(ConfigError, match=r"^override trainer\.base=shared: trainer\.base=shared maps the engine's FP8 "
                                          r"weights, but "
                                          r"engine\.precision=bf16 has none"):
        load_config(None, ["trainer.base=shared"])
    for precision in ("w8a8", "w8a16"):
        assert load_config(None, ["trainer.base=shared", f"engine.precision={precision}"]).trainer.base == "shared"


def test_one_list_of_engine_precisions_and_one_auto_dtype_rule():
    from typing import get_args

    from epirl.config import ENGINE_PRECISIONS, EngineConfig, concrete_dtype
    from epirl.model.loading import resolve_dtype

    assert get_args(EngineConfig.model_fields["precision"].annotation) == ENGINE_PRECISIONS
    assert [concrete_dtype("auto", d) for d in ("cuda", "cpu")] == ["bfloat16", "float32"]
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_kernel_fields_of_older_recipes_move_or_go(caplog):
    """`trainer.fused_slices` moved to `kernels.fused_slices`; `trainer.w8a16_tma` (the removed pointer-only table) is
    dropped; both with a warning, so that older recipes still load."""
    import logging

    assert load_config(None, []).kernels.fused_slices is True  # the default: qkv as one call
    with caplog.at_level(logging.WARNING):
        cfg = load_config(None, ["trainer.fused_slices=false", "trainer.w8a16_tma=false"])
    assert cfg.kernels.fused_slices is False and not hasattr(cfg.trainer, "w8a16_tma")
    assert "kernels.fused_slices" in caplog.text and "w8a16_tma is ignored" in caplog.text
    assert load_config(None, ["kernels.fused_slices=false"]).kernels.fused_slices is False


def test_plan_says_which_w8a16_tiles_run():
    """The plan's trainer row names the W8A16 GEMM's tiles where that kernel runs (CUDA, an FP8 base or the matched
    engine), and nothing where it does not."""
    from epirl.plan import _w8a16_tiles

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fp8 = load_config(None, ["trainer.base=fp8"])
    assert "TMA-load tiles" in _w8a16_tiles(fp8, cuda)
    assert "TMA-load tiles" in _w8a16_tiles(load_config(None, ["engine.precision=w8a16"]), cuda)
    assert _w8a16_tiles(fp8, cpu) == "" and _w8a16_tiles(load_config(None, []), cuda) == ""
    assert _w8a16_tiles(fp8, cuda).endswith("q, k, v as one call")
    per_slice = load_config(None, ["trainer.base=fp8", "kernels.fused_slices=false"])
    assert "one call per slice" in _w8a16_tiles(per_slice, cuda)