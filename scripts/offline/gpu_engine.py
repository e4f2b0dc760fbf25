"""GPU evidence for the rollout engine, in one run on an H200 with vLLM 0.26 staged.

    source ~/vllm-env.sh && python scripts/offline/gpu_engine.py            # ~6-8 min
    python scripts/offline/gpu_engine.py --precisions w8a8 --skip-smollm2     # another engine, its own process

One 8B-shape engine per process (`--precisions`: vLLM's sleep-mode allocator serves one instance per process);
gpu_benchmarks.sh runs one process per engine. Sections (each in its own try/except: one failure prints its error and
the rest still run):
  tpot      decode time per output token, batch 1 and 32, 128-token prompts, 256 new tokens, CUDA
            graphs, Qwen3-8B-shaped dummy weights, rank-64 adapter on all 7 projections: w8a16 (matched,
            epirl kernel), w8a8 (vLLM fp8 + vLLM LoRA; also vLLM fp8 without adapter) or w8a16-bitwise
            (`--graphs`: its cudagraph mode)
  publish   in-memory publish of a rank-64 adapter on the 8B shape (goal <= 50 ms)
  layer     matched engine: a captured qkv_proj / down_proj output vs the kernel recomputed on the
            same input with the trainer's tensors (torch.equal), on the 8B shape
  shared    `trainer.base: shared`: every view's data_ptr inside the engine's FP8 weight storage,
            CUDA memory after building Fp8LoRALinear layers on the views (+LoRA +Adam only)
  kv        KV release / re-acquire x20 with weights resident: bytes freed, seconds, greedy output
            identical every cycle, weight checksums verified by the engine after each wake
  smollm2   real SmolLM2 weights (kit built with WITH_SMOLLM2=1): matched engine vs the FP8 trainer
            (epirl.model.load_policy, trainer.base=shared) log-probs, bitwise / max |Δ|, vs w8a8
Prints one table at the end and writes it as JSON to $OUT/gpu_engine_<tag>.json when $OUT is set.
Run `kv` in its own process (`--sections kv`): a failed re-map would poison the CUDA context.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # bench_engine's helpers

from bench_engine import (QWEN3_8B, decode_tpot, ensure_epirl_kernels, make_cfg, publish_ms,  # noqa: E402
                          qwen3_8b_dir, random_adapter)

ROWS: list[tuple[str, str, object]] = []


def row(section: str, metric: str, value) -> None:
    ROWS.append((section, metric, value))
    print(f"[{section}] {metric}: {value}", flush=True)


def section_8b(args, model_dir: str, precision: str) -> None:
    """Start one 8B-shaped engine; run tpot / publish / layer / shared / kv on it."""
    import torch

    from epirl.engine import RolloutEngine

    try:
        engine = RolloutEngine(make_cfg(model_dir, precision, rank=64, eager=args.eager, graphs=args.graphs),
                               load_format="dummy", skip_tokenizer_init=True)
    except Exception as e:  # e.g. torch.compile / graph capture of the plugin op: keep the evidence coming
        row(precision, "ERROR starting with CUDA graphs (retrying eager)", f"{type(e).__name__}: {str(e)[:200]}")
        traceback.print_exc()
        torch.cuda.empty_cache()
        engine = RolloutEngine(make_cfg(model_dir, precision, rank=64, eager=True),
                               load_format="dummy", skip_tokenizer_init=True)
    row(precision, "engine start s", f"{engine.start_s:.1f} (eager={engine.cfg.engine.enforce_eager})")
    try:
        adapter = random_adapter(QWEN3_8B, 64, "cuda")
        sections = [("publish", lambda: _publish(engine, adapter, precision)),
                    ("tpot", lambda: _tpot(engine, precision, adapter) if not args.skip_tpot else None),
                    ("layer", lambda: _layer_bitwise(engine, adapter) if precision == "w8a16" else None),
                    ("shared", lambda: _shared(engine) if precision == "w8a16" else None),
                    ("kv", lambda: _kv_cycles(engine, precision) if precision == "w8a16" or args.kv_all else None)]
        for name, fn in sections:
            if name in args.sections.split(","):
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
    row(precision, "publish rank-64 ms (median of 6)", round(publish_ms(engine, adapter), 1))


def _tpot(engine, precision, adapter):
    if engine.lora_request(True) is None:  # `--sections tpot` alone: nothing published yet, the rows would run no LoRA
        engine.publish(adapter, step=0)
    for batch in (1, 32):
        row(precision, f"TPOT b{batch} with adapter ms", round(decode_tpot(engine, batch, True), 3))
    if precision == "w8a8":
        row("vllm-fp8", "TPOT b1 no adapter ms", round(decode_tpot(engine, 1, False), 3))
        row("vllm-fp8", "TPOT b32 no adapter ms", round(decode_tpot(engine, 32, False), 3))


def _layer_bitwise(engine, adapter):
    import torch

    from epirl.engine import plugin
    from epirl.engine.lora_publish import modules_of
    from epirl.kernels.w8a16.slices import fused_layer_call
    from epirl.model.loading import runs_as_one_call

    engine.publish(adapter, step=100)
    # Forward hooks do not fire inside CUDA-graph replay or compiled regions: run this with --eager.
    names = ["model.layers.5.self_attn.qkv_proj", "model.layers.5.mlp.down_proj"]
    with plugin.captured_layer_io(engine.vllm_model(), names) as cap:
        engine.score([list(range(1000, 1064))], [list(range(2000, 2008))])
    views, lora = engine.base_weight_views(), modules_of(adapter)
    scale = engine.cfg.lora.alpha / engine.cfg.lora.rank
    for name, subs in [(names[0], ["q_proj", "k_proj", "v_proj"]), (names[1], ["down_proj"])]:
        x, y = cap[name]
        parent = name.rsplit(".", 1)[0]
        members = [f"{parent}.{s}" for s in subs]
        ref = fused_layer_call(x, [views[m][0] for m in members], views[members[0]][1], [lora[m][0] for m in members],
                               [lora[m][1] for m in members], scale, one_call=runs_as_one_call(name.split(".")[-1]))
        row("w8a16", f"{name.split('.')[-1]} engine == kernel (M={x.shape[0]})",
            f"bitwise={torch.equal(y, ref)} max|Δ|={(y.float() - ref.float()).abs().max().item():.3g}")


def _shared(engine):
    import torch

    from epirl.kernels import Fp8LoRALinear

    views = engine.base_weight_views()
    storages = {}
    for module in engine.vllm_model().modules():
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
    row(precision, "kv mode", engine.kv_release_mode)
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
        cfg = make_cfg(path, precision, rank=8, max_model_len=512, eager=True, gpu_util=0.2, max_num_seqs=8)
        # No sleep mode here: the trainer built on the w8a16 engine's codes outlives that engine (it is
        # reused against w8a8), which the CuMemAllocator pool would unmap at shutdown.
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"base": "shared"}),
                                     "engine": cfg.engine.model_copy(update={"kv_release": False})})
        engine = RolloutEngine(cfg)
        try:
            policy = load_policy(cfg, torch.device("cuda"), engine=engine) if precision == "w8a16" else results["policy"]
            results.setdefault("policy", policy)
            if precision == "w8a16":
                emb = policy.model.get_input_embeddings().weight
                report = policy.memory_report()
                row("smollm2", "trainer embedding = engine's (data_ptr)",
                    emb.data_ptr() == engine.embedding_views()["input"].data_ptr())
                row("smollm2", "trainer base owned / engine-shared MiB",
                    f"{report['base_weight_bytes'] / 2**20:.2f} / {report['base_shared_bytes'] / 2**20:.1f}")
            tensors = policy.lora_state_dict()
            if precision == "w8a16":  # non-zero B (fixed seed) so the adapter matters; same for w8a8
                gen = torch.Generator(device="cpu").manual_seed(0)
                for k in sorted(tensors):
                    if "lora_B" in k:
                        tensors[k].copy_(torch.randn(tensors[k].shape, generator=gen) * 0.02)
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
    from epirl.model.policy import peft_key

    for name, mod in lora_modules(policy.model).items():
        mod.lora_A.data.copy_(tensors[peft_key(name, "A")])
        mod.lora_B.data.copy_(tensors[peft_key(name, "B")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-tpot", action="store_true")
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--kv-all", action="store_true", help="KV cycles on the w8a8 engine too")
    parser.add_argument("--precisions", default="w8a16", help="the 8B-shape engine (w8a16, w8a8, w8a16-bitwise; one "
                        "per process); `none`: SmolLM2 section only")
    parser.add_argument("--sections", default="publish,tpot,layer,shared,kv",
                        help="8B-shape sections to run; run `kv` in its own process: a failed KV re-map can "
                             "poison the CUDA context for everything after it")
    parser.add_argument("--tag", default="main", help="suffix of $OUT/gpu_engine_<tag>.json")
    parser.add_argument("--eager", action="store_true", help="engines without CUDA graphs (faster start)")
    parser.add_argument("--graphs", help="vLLM's cudagraph mode for the 8B-shape engines (default: the engine's own)")
    args = parser.parse_args()
    precisions = [p for p in args.precisions.split(",") if p not in ("", "none")]
    if len(precisions) > 1:  # a second sleep-mode engine in one process fails in vLLM's CuMem allocator
        parser.error(f"--precisions {args.precisions}: one 8B-shape engine per process; run once per precision")
    ensure_epirl_kernels()
    import torch
    import vllm

    row("env", "vllm / torch / gpu", f"{vllm.__version__} / {torch.__version__} / {torch.cuda.get_device_name()}")
    model_dir = qwen3_8b_dir()
    t0 = time.perf_counter()
    for precision in precisions:
        _guard(f"{precision}/engine", lambda: section_8b(args, model_dir, precision))
    if not args.skip_smollm2:
        _guard("smollm2", section_smollm2)
    row("env", "total s", round(time.perf_counter() - t0, 1))
    print("\n| section | metric | value |\n|---|---|---|")
    for section, metric, value in ROWS:
        print(f"| {section} | {metric} | {value} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"gpu_engine_{args.tag}.json").write_text(json.dumps(ROWS, indent=1, default=str))


if __name__ == "__main__":
    main()
