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
rank-64 adapter on all 7 projections; batch-1 TPOT (128-token prompt, 256 tokens) with/without adapter and 32
tenants (32 adapter slots, 256 requests of 512 + 256 tokens), once with vLLM's LoRA kernels and once with
EPIRL_SERVING_KERNELS=timed, each in a fresh process (~3-4 min each: engine start 1-2 min).
Usage: python scripts/bench_serving.py [--json PATH] [--sweep] [--dispatch] [--vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

RANK, SIGMA = 64, 2.0
LAYER = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096)]
TOKENS = [1, 4, 8, 16]
SWEEP = [dict(BN=64, BT=16, BK=256, num_warps=4, num_stages=4), dict(BN=64, BT=16, BK=128, num_warps=4, num_stages=4),
         dict(BN=64, BT=16, BK=256, num_warps=4, num_stages=3), dict(BN=128, BT=16, BK=128, num_warps=4, num_stages=4),
         dict(BN=128, BT=16, BK=256, num_warps=8, num_stages=3), dict(BN=128, BT=16, BK=256, num_warps=4, num_stages=3)]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), measured here."""
    from triton.testing import do_bench

    src = torch.empty(2 * 2 ** 30, dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=20, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


SLICES = {"qkv": [4096, 1024, 1024], "o": [4096], "gate_up": [12288, 12288], "down": [4096]}  # as vLLM holds them


def build_layer():
    from epirl.kernels.w8a8_multi_lora.dispatch import Shape
    from epirl.kernels.w8a8_multi_lora.timing import random_projection

    layer = []
    g = torch.Generator(device="cuda").manual_seed(7)
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
    from epirl.kernels.w8a8_multi_lora.timing import vendor_base
    from epirl.kernels.w8a8_multi_lora.triton import expand_into, pdl_supported, w8a8_multi_lora_slices

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
    print("\n| tokens | floor µs | base µs | " + " | ".join(f"{n} µs (×base)" for n in names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for r in rows:
        cells = " | ".join(f"{r[n]:.1f} ({r[n] / r['base']:.3f})" for n in names)
        print(f"| {r['M']} | {r['floor_us']:.1f} | {r['base']:.1f} | {cells} |")
    return rows


def projection_table(layer):
    """Per projection at 1 and 16 tokens: fused (best path) vs base, to see where the layer's time goes."""
    from epirl.kernels import w8a8_multi_lora
    from epirl.kernels.gpu_timing import graph_us
    from epirl.kernels.w8a8_multi_lora.timing import vendor_base

    rows = []
    print("\n| projection | tokens | base µs | fused µs | fused no-LoRA µs |\n|---|---|---|---|---|")
    for p in layer:
        for M in (1, 16):
            x = torch.randn(M, p["K"], device="cuda", dtype=torch.bfloat16)
            ids = torch.zeros(M, device="cuda", dtype=torch.int64)
            none = torch.full_like(ids, -1)
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
    from epirl.kernels.w8a8_multi_lora.timing import vendor_base

    rows = []
    print("\n| projection | ours max / mean abs Δ vs reference | vendor path max / mean abs Δ | mean abs y |")
    print("|---|---|---|---|")
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
            t = []
            for M in (1, 16):
                v = variants(layer, M, cfg)
                t.append(graph_us(v.get("fused-pdl", v["fused"])))
        except Exception as exc:  # a config that does not compile (shared memory) is reported, not fatal
            print(f"| {tag} | failed: {str(exc).splitlines()[0][:80]} | |")
            continue
        rows.append(dict(config=tag, us_1=t[0], us_16=t[1]))
        print(f"| {tag} | {t[0]:.1f} | {t[1]:.1f} |", flush=True)
    return rows


def dispatch_table(cache_dir):
    """The engine's timed dispatch on this layer's projection shapes (buckets 1 and 16), as the engine runs it."""
    from epirl.kernels.w8a8_multi_lora import dispatch
    from epirl.kernels.gpu_timing import graph_us
    from epirl.kernels.w8a8_multi_lora.timing import gpu_candidates

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
TENANTS, TENANT_REQUESTS, TENANT_PROMPT, TENANT_OUTPUT = 32, 256, 512, 256


def write_model_and_adapter(root):
    """Qwen3-8B config (dummy weights) and one random rank-64 PEFT adapter on all 7 projections."""
    from safetensors.torch import save_file

    model, adapter = os.path.join(root, "qwen3_8b"), os.path.join(root, "adapter")
    os.makedirs(model, exist_ok=True)
    os.makedirs(adapter, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(QWEN3_8B, f)
    c = QWEN3_8B
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for mod, (n_out, n_in) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{mod}"
            tensors[f"{stem}.lora_A.weight"] = (torch.randn(RANK, n_in, generator=g) / n_in ** 0.5).bfloat16()
            tensors[f"{stem}.lora_B.weight"] = (torch.randn(n_out, RANK, generator=g) * 0.01).bfloat16()
    save_file(tensors, os.path.join(adapter, "adapter_model.safetensors"))
    with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
        json.dump(dict(peft_type="LORA", r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, bias="none",
                       base_model_name_or_path=model, task_type="CAUSAL_LM"), f)
    return model, adapter


def vllm_child(setting, json_path):
    """One engine with EPIRL_SERVING_KERNELS=setting: batch-1 TPOT with/without adapter, 32-tenant throughput."""
    os.environ["EPIRL_SERVING_KERNELS"] = setting
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from epirl.engine import serving_lora

    serving_lora.install()  # before the model is built: compile and CUDA graphs see the op
    root = os.environ.get("EPIRL_BENCH_DIR", "/tmp/epirl_bench_serving")
    model, adapter = write_model_and_adapter(root)
    llm = LLM(model=model, load_format="dummy", quantization="fp8", enable_lora=True, max_lora_rank=RANK,
              max_loras=TENANTS, max_num_seqs=256, max_model_len=1024, skip_tokenizer_init=True,
              gpu_memory_utilization=0.85, seed=0)
    loras = [LoRARequest(f"tenant{t}", t + 1, adapter) for t in range(TENANTS)]
    g = torch.Generator().manual_seed(1)

    def prompt(n):
        return {"prompt_token_ids": torch.randint(1000, 100000, (n,), generator=g).tolist()}

    def timed(prompts, max_tokens, lora):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return time.perf_counter() - t

    result = dict(setting=setting)
    for tag, lora in (("adapter", loras[0]), ("no_adapter", None)):
        p = [prompt(128)]
        timed(p, 8, lora)  # warm-up (and the timed dispatch's first calls)
        tpots = [(timed(p, 257, lora) - timed(p, 1, lora)) / 256 * 1e3 for _ in range(3)]
        result[f"tpot_ms_{tag}"] = sum(tpots) / len(tpots)
    prompts = [prompt(TENANT_PROMPT) for _ in range(TENANT_REQUESTS)]
    timed(prompts[:TENANTS], 4, [loras[i % TENANTS] for i in range(TENANTS)])
    elapsed = timed(prompts, TENANT_OUTPUT, [loras[i % TENANTS] for i in range(TENANT_REQUESTS)])
    result["tenants_tok_s"] = TENANT_REQUESTS * TENANT_OUTPUT / elapsed
    timed([prompt(128)], 1, loras[0])  # leaves vLLM's token map at 128 prefill tokens on the adapter
    result["layer_numerics"] = llm.apply_model(vllm_layer_numerics)[0]
    print(json.dumps(result), flush=True)
    with open(json_path, "w") as f:
        json.dump(result, f)


def vllm_layer_numerics(model):
    """The first decoder layer's LoRA linears: ours (EPIRL serving op) vs vLLM's own apply (CUTLASS FP8 + punica)
    on the same slot buffers and token map, max / mean |Δ|; activation codes and scales vs vLLM's scaled_fp8_quant."""
    from vllm import _custom_ops as vllm_ops
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    from epirl.engine import serving_lora
    from epirl.kernels import quantize_activation_fp8

    previous, rows = serving_lora.mode(), {}
    for name, layer in model.named_modules():
        if not isinstance(layer, BaseLinearLayerWithLoRA) or ".layers.0." not in f".{name}.":
            continue
        M = layer.punica_wrapper.token_lora_indices.numel()
        x = torch.randn(M, layer.input_size, device="cuda", dtype=torch.bfloat16)
        serving_lora.set_mode("fused")
        ours = serving_lora.serving_apply(layer, x, None)
        serving_lora.set_mode("off")
        theirs = layer.apply(x)
        if ours is None:
            rows[name] = "not served"
            continue
        d = (ours.float() - theirs.float()).abs()
        q, s = quantize_activation_fp8(x)
        q_v, s_v = vllm_ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
        rows[name] = dict(max_abs=d.max().item(), mean_abs=d.mean().item(),
                          mean_abs_y=theirs.float().abs().mean().item(),
                          codes_bit_exact=bool(torch.equal(q.view(torch.uint8), q_v.view(torch.uint8))),
                          scales_bit_exact=bool(torch.equal(s.reshape(-1), s_v.reshape(-1))))
    serving_lora.set_mode(previous)
    return rows


def vllm_mode(json_path):
    """Both settings in fresh processes, then the ratios (ours / vLLM's)."""
    import subprocess
    import sys

    rows = {}
    for setting in ("0", "timed"):
        path = f"{json_path}.{setting}.json"
        subprocess.run([sys.executable, __file__, "--vllm-child", setting, "--json", path], check=True)
        with open(path) as f:
            rows[setting] = json.load(f)
    ours, theirs = rows["timed"], rows["0"]
    print("\n| setting | TPOT b1 adapter ms | TPOT b1 no adapter ms | 32 tenants tok/s |\n|---|---|---|---|")
    for name, r in (("vLLM fp8 + LoRA", theirs), ("epirl serving kernels", ours)):
        print(f"| {name} | {r['tpot_ms_adapter']:.2f} | {r['tpot_ms_no_adapter']:.2f} | {r['tenants_tok_s']:.0f} |")
    print(f"\nTPOT ratio (target <= 0.75): {ours['tpot_ms_adapter'] / theirs['tpot_ms_adapter']:.3f}; "
          f"32-tenant throughput ratio (target >= 1.05): {ours['tenants_tok_s'] / theirs['tenants_tok_s']:.3f}")
    print("\nlayer 0 vs vLLM's own path (CUTLASS + punica), 128 tokens:")
    for name, r in ours["layer_numerics"].items():
        print(f"  {name}: {r}")
    with open(json_path, "w") as f:
        json.dump(rows, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_serving.json"))
    ap.add_argument("--sweep", action="store_true", help="also time K2 decode tile configs")
    ap.add_argument("--dispatch", action="store_true", help="also run the timed dispatch on the layer's shapes")
    ap.add_argument("--vllm", action="store_true", help="end-to-end TPOT / 32-tenant runs (needs vLLM)")
    ap.add_argument("--vllm-child", default=None, help=argparse.SUPPRESS)  # one engine per process
    args = ap.parse_args()
    if args.vllm_child:
        return vllm_child(args.vllm_child, args.json)
    if args.vllm:
        return vllm_mode(args.json)
    t0 = time.time()
    bandwidth = copy_bandwidth()
    print(f"# copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    layer = build_layer()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, bandwidth=bandwidth)
    result["layer"] = layer_table(layer, bandwidth)
    result["projections"] = projection_table(layer)
    result["numerics"] = numerics_table(layer)
    if args.sweep:
        result["sweep"] = sweep_table(layer)
    if args.dispatch:
        result["dispatch"] = dispatch_table(os.environ.get("OUT", "."))
    print(f"# done in {time.time() - t0:.0f}s", flush=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
