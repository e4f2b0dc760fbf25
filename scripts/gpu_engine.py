"""GPU evidence for the rollout engine (issue 5), in one run on the H200 with vLLM 0.26 staged.

    source ~/vllm-env.sh && python scripts/gpu_engine.py            # ~6-8 min
    python scripts/gpu_engine.py --skip-smollm2 --skip-tpot           # quicker subsets

Sections (each in its own try/except: one failure prints its error and the rest still run):
  tpot      decode time per output token, batch 1 and 32, 128-token prompts, 256 new tokens, CUDA
            graphs, Qwen3-8B-shaped dummy weights, rank-64 adapter on all 7 projections:
            w8a16 (matched, epirl kernel) vs w8a8 (vLLM fp8 + vLLM LoRA) vs vLLM fp8 without adapter
  publish   in-memory publish of a rank-64 adapter on the 8B shape (goal <= 50 ms)
  layer     matched engine: a captured qkv_proj / down_proj output vs the kernel recomputed on the
            same input with the trainer's tensors (torch.equal), on the 8B shape
  shared    `trainer.base: shared`: every view's data_ptr inside the engine's FP8 weight storage,
            CUDA memory after building Fp8LoRALinear layers on the views (+LoRA +Adam only)
  kv        KV release / re-acquire x20 with weights resident: bytes freed, seconds, greedy output
            identical every cycle, weight checksums verified by the engine after each wake
  smollm2   real SmolLM2 weights (kit built with WITH_SMOLLM2=1): matched engine vs the FP8 trainer
            (epirl.model.load_policy, trainer.base=shared) log-probs, bitwise / max |Δ|, vs w8a8
Prints one table at the end and writes it as JSON to $OUT/gpu_engine.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS: list[tuple[str, str, object]] = []


def row(section: str, metric: str, value) -> None:
    ROWS.append((section, metric, value))
    print(f"[{section}] {metric}: {value}", flush=True)


def ensure_epirl_kernels() -> None:
    """`epirl.kernels` is the top-level `kernels/` folder once installed; alias it when run from a checkout."""
    try:
        import epirl.kernels  # noqa: F401
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "epirl.kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["epirl.kernels"] = module
        spec.loader.exec_module(module)


QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu",
                attention_bias=False, bos_token_id=151643, eos_token_id=151645)


def make_cfg(model_path: str, precision: str, rank: int = 64, max_model_len: int = 1024, eager=False, gpu_util=0.40):
    from epirl.config import EpirlConfig

    return EpirlConfig.model_validate({
        "model": {"path": model_path, "max_model_len": max_model_len, "dtype": "bfloat16"},
        "engine": {"precision": precision, "gpu_memory_utilization": gpu_util, "max_num_seqs": 64,
                   "enforce_eager": eager, "kv_release": True},
        "lora": {"rank": rank, "alpha": 2.0 * rank},
    })


def random_adapter(hf_cfg: dict, rank: int, device="cuda", std=0.02, seed=0) -> dict:
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    h, i = hf_cfg["hidden_size"], hf_cfg["intermediate_size"]
    hd = hf_cfg.get("head_dim") or h // hf_cfg["num_attention_heads"]
    q, kv = hf_cfg["num_attention_heads"] * hd, hf_cfg["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    out = {}
    for layer in range(hf_cfg["num_hidden_layers"]):
        for mod, (n_out, n_in) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{mod}"
            out[f"{stem}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) * std).to(device, torch.bfloat16)
            out[f"{stem}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * std).to(device, torch.bfloat16)
    return out


def decode_tpot(engine, batch: int, use_adapter: bool, prompt_len=128, new_tokens=256, repeats=2) -> float:
    """ms per output token: (t(new_tokens) - t(1)) / (new_tokens - 1), greedy, ignore_eos, mean of repeats."""
    import torch
    from vllm import SamplingParams

    from epirl.engine import plugin

    g = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(100, 100000, (prompt_len,), generator=g).tolist()}
               for _ in range(batch)]
    lora = engine.adapter.request if (use_adapter and engine.adapter) else None

    def run(n_tokens):
        params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        engine.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        with plugin.active_adapter(engine, lora):
            engine.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return time.perf_counter() - t0

    run(8)  # warm-up
    times = [(run(new_tokens) - run(1)) / (new_tokens - 1) for _ in range(repeats)]
    return 1e3 * sum(times) / len(times)


def section_8b(args, model_dir: str, precision: str) -> None:
    """Start one 8B-shaped engine; run tpot / publish / layer / shared / kv on it."""
    import torch

    from epirl.engine import RolloutEngine

    cfg = make_cfg(model_dir, precision)
    engine = RolloutEngine(cfg, load_format="dummy", skip_tokenizer_init=True)
    row(precision, "engine start s", round(engine.start_s, 1))
    try:
        adapter = random_adapter(QWEN3_8B, 64)
        for name, fn in [("publish", lambda: _publish(engine, adapter, precision)),
                         ("tpot", lambda: _tpot(engine, precision) if not args.skip_tpot else None),
                         ("layer", lambda: _layer_bitwise(engine, adapter) if precision == "w8a16" else None),
                         ("shared", lambda: _shared(engine) if precision == "w8a16" else None),
                         ("kv", lambda: _kv_cycles(engine, precision) if precision == "w8a16" or args.kv_all else None)]:
            _guard(f"{precision}/{name}", fn)
    finally:
        engine.close()
        del engine
        torch.cuda.empty_cache()


def _guard(label, fn):
    try:
        fn()
    except Exception as e:  # keep going: one broken section must not lose the others
        row(label, "ERROR", f"{type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc()


def _publish(engine, adapter, precision):
    times = [engine.publish(adapter, step=s)["engine/publish_s"] * 1e3 for s in range(6)]
    row(precision, "publish rank-64 ms (median of 6)", round(sorted(times)[3], 1))


def _tpot(engine, precision):
    for batch in (1, 32):
        row(precision, f"TPOT b{batch} with adapter ms", round(decode_tpot(engine, batch, True), 3))
    if precision == "w8a8":
        row("vllm-fp8", "TPOT b1 no adapter ms", round(decode_tpot(engine, 1, False), 3))
        row("vllm-fp8", "TPOT b32 no adapter ms", round(decode_tpot(engine, 32, False), 3))


def _layer_bitwise(engine, adapter):
    import torch

    from epirl.engine import compat
    from epirl.engine.lora_publish import modules_of
    from epirl.kernels import w8a16_lora

    engine.publish(adapter, step=100)
    mods = dict(compat.model(engine.llm).named_modules())
    names = ["model.layers.5.self_attn.qkv_proj", "model.layers.5.mlp.down_proj"]
    cap = {}
    hooks = [mods[n].register_forward_hook(lambda m, a, o, n=n: cap.setdefault(
        n, (a[0].clone(), (o[0] if isinstance(o, tuple) else o).clone()))) for n in names]
    try:
        prompt = list(range(1000, 1064))
        engine.score([prompt], [list(range(2000, 2008))])
    finally:
        for h in hooks:
            h.remove()
    views, lora = engine.base_weight_views(), modules_of(adapter)
    scale = engine.cfg.lora.alpha / engine.cfg.lora.rank
    for name, subs in [(names[0], ["q_proj", "k_proj", "v_proj"]), (names[1], ["down_proj"])]:
        x, y = cap[name]
        parent = name.rsplit(".", 1)[0]
        ref = torch.cat([w8a16_lora(x, *views[f"{parent}.{s}"], *lora[f"{parent}.{s}"], scale) for s in subs], -1)
        row("w8a16", f"{name.split('.')[-1]} engine == kernel (M={x.shape[0]})",
            f"bitwise={torch.equal(y, ref)} max|Δ|={(y.float() - ref.float()).abs().max().item():.3g}")


def _shared(engine):
    import torch

    from epirl.engine import compat
    from epirl.kernels import Fp8LoRALinear

    views = engine.base_weight_views()
    storages = {}
    for module in compat.model(engine.llm).modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.dtype == torch.float8_e4m3fn:
            storages[w.untyped_storage().data_ptr()] = w.untyped_storage().nbytes()
    inside = sum(any(b <= c.data_ptr() < b + n for b, n in storages.items()) for c, _ in views.values())
    row("shared", "views inside engine FP8 storage", f"{inside}/{len(views)}")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    layers = [Fp8LoRALinear.from_codes(c, s, rank=64, alpha=128.0, seed=0) for c, s in views.values()]
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    lora_bytes = sum(p.numel() * p.element_size() for p in params)
    codes_bytes = sum(c.numel() for c, _ in views.values())
    row("shared", "trainer layers built: memory growth GiB", round(grown / 2**30, 3))
    row("shared", "LoRA params GiB (x4 with grads+Adam)", round(lora_bytes / 2**30, 3))
    row("shared", "FP8 base codes GiB (not copied)", round(codes_bytes / 2**30, 3))
    row("shared", "all layers reuse engine codes (data_ptr equal)",
        all(layer.codes.data_ptr() == c.data_ptr() for layer, (c, _) in zip(layers, views.values()))
        if hasattr(layers[0], "codes") else "n/a (Fp8LoRALinear has no .codes)")
    del layers, params, opt
    torch.cuda.empty_cache()


def _kv_cycles(engine, precision, cycles=20):
    prompt = [list(range(3000, 3100))]
    ref = engine.generate(prompt, n=1, max_tokens=16, temperature=0.0)[0][0].token_ids
    freed, t_rel, t_acq, same = [], [], [], 0
    for _ in range(cycles):
        r = engine.release_kv()
        a = engine.reacquire_kv()  # checksums the weights; raises on corruption
        freed.append(r["engine/kv_released_bytes"])
        t_rel.append(r["engine/kv_release_s"])
        t_acq.append(a["engine/kv_reacquire_s"])
        same += engine.generate(prompt, n=1, max_tokens=16, temperature=0.0)[0][0].token_ids == ref
    from epirl.engine import compat

    row(precision, "kv mode", compat.kv_release_mode(engine.llm))
    row(precision, "kv freed GiB (mean)", round(sum(freed) / len(freed) / 2**30, 2))
    row(precision, "kv release / re-acquire s (mean)", f"{sum(t_rel) / cycles:.3f} / {sum(t_acq) / cycles:.3f}")
    row(precision, f"greedy identical after cycle (of {cycles})", same)


def section_smollm2() -> None:
    """Real SmolLM2: matched engine vs the FP8 trainer on the engine's shared codes, and w8a8 for scale."""
    import torch

    from epirl.engine import RolloutEngine
    from epirl.model.loading import load_policy
    from epirl.model.smollm2 import smollm2_path

    path = smollm2_path()
    results = {}
    for precision in ("w8a16", "w8a8"):
        cfg = make_cfg(path, precision, rank=8, max_model_len=512, eager=True, gpu_util=0.2)
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"base": "shared"})})
        engine = RolloutEngine(cfg)
        try:
            policy = load_policy(cfg, torch.device("cuda"), engine=engine) if precision == "w8a16" else results["policy"]
            results.setdefault("policy", policy)
            tensors = policy.lora_state_dict()
            for k, v in tensors.items():  # non-zero B so the adapter matters
                if "lora_B" in k:
                    v.normal_(0, 0.02, generator=torch.Generator(v.device).manual_seed(hash(k) % 2**31))
            _load_into_policy(policy, tensors)
            engine.publish(tensors, step=1)
            tok = engine.tokenizer
            prompt = tok("The capital of France is", add_special_tokens=False)["input_ids"]
            comp = engine.generate([prompt], n=1, max_tokens=24, temperature=1.0, seed=0)[0][0].token_ids
            eng = torch.tensor(engine.score([prompt], [comp])[0])
            ids = torch.tensor([prompt + comp], device="cuda")
            tr, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], 1.0, 1024)
            tr = tr[0, len(prompt) - 1:].float().cpu()
            d = (eng - tr).abs()
            row("smollm2", f"{precision} engine vs FP8 trainer max|Δ logp| / mean",
                f"{d.max().item():.4g} / {d.mean().item():.4g} (bitwise={torch.equal(eng, tr)})")
        finally:
            engine.close()
            torch.cuda.empty_cache()


def _load_into_policy(policy, tensors):
    from epirl.model.lora import lora_modules

    mods = lora_modules(policy.model)
    for name, mod in mods.items():
        for which in ("lora_A", "lora_B"):
            key = next(k for k in tensors if k.endswith(f"{name}.{which}.weight"))
            getattr(mod, which).data.copy_(tensors[key])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-tpot", action="store_true")
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--kv-all", action="store_true", help="KV cycles on the w8a8 engine too")
    parser.add_argument("--precisions", default="w8a16,w8a8")
    args = parser.parse_args()
    ensure_epirl_kernels()
    import torch
    import vllm

    row("env", "vllm / torch / gpu", f"{vllm.__version__} / {torch.__version__} / {torch.cuda.get_device_name()}")
    model_dir = tempfile.mkdtemp(prefix="qwen3-8b-shape-")
    Path(model_dir, "config.json").write_text(json.dumps(QWEN3_8B))
    t0 = time.perf_counter()
    for precision in args.precisions.split(","):
        _guard(f"{precision}/engine", lambda: section_8b(args, model_dir, precision))
    if not args.skip_smollm2:
        _guard("smollm2", section_smollm2)
    row("env", "total s", round(time.perf_counter() - t0, 1))
    print("\n| section | metric | value |\n|---|---|---|")
    for section, metric, value in ROWS:
        print(f"| {section} | {metric} | {value} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_engine.json").write_text(json.dumps(ROWS, indent=1, default=str))


if __name__ == "__main__":
    main()
