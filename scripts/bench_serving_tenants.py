"""Multi-tenant serving kernels benchmark (H200): one Qwen3-8B decoder layer (qkv as q, k, v slices, o, gate_up as
gate, up slices, down; each slice with its own `[T, r, K]` / `[T, N_s, r]` slot buffers, as vLLM holds them) at M
tokens spread evenly over min(T, M) rank-64 adapters in random token order: the batches of issue 13's 32-tenant workload
(decode steps of 32-256 sequences, prefill chunks of up to 8192 tokens). Each variant is replayed from one CUDA graph
with the L2 flushed before each layer call (`epirl.kernels.gpu_timing.graph_us`), µs per layer; ratios against
`vendor+vllm`, what vLLM's engine runs for these batches.

  base          vendor FP8 linear without adapter: per-token quantization + torch._scaled_mm (cuBLASLt)
  vendor+vllm   base + vLLM's own LoRA kernels (lora_shrink + lora_expand, punica structure; token metadata
                prepared outside the graph, as vLLM does once per step); only where vLLM is importable
  fused         epirl's w8a8_multi_lora_slices as the engine calls it: up to 32 tokens K1 (quantize + per-token
                shrink) and K2's decode tile with PDL; above, the prefill path (grouped tensor-core shrink, K2 with
                the multi-adapter epilogue); tokens sorted inside the graph as in the engine
  fused-k1      the prefill path as it was before the grouped shrink: K1's per-token shrink (CUDA cores, each
                token's program reads its adapter's A) and K2 summing the chunk partials in every weight tile
  vendor+epirl  base + epirl's shrink (grouped above 32 tokens) + K2's expand in place
  vendor+seg    base + the segment-tiled shrink and expand (one adapter per tile; the segments prepared outside the
                graph, as vendor+vllm's metadata)
Also checks every variant against the float64 reference on a sample of rows (max |Δ| / mean |y| per variant).
--sweep: the fused path with other K2 token tiles (the dispatch's PREFILL_VARIANTS, BT 64 / 32: fewer adapters per
tile, so fewer epilogue dots, against more passes over the weights, and one more) and grouped-shrink tiles, as
`fused[<tag>]` columns, to pick per-bucket configs from measurements.
Usage: python scripts/bench_serving_tenants.py [--tokens 32 256 ...] [--tenants 1 8 32] [--sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import LAYER, RANK, SIGMA, SLICES  # noqa: E402

TOKENS = [16, 32, 64, 256, 1024, 8192]  # 16: a decode step in which every token may have its own adapter
# --sweep: (K2 config, grouped-shrink config) pairs tried besides the defaults; tag -> (k2, shrink)
# (the engine's timed dispatch tries PREFILL_VARIANTS too: `fused[bt64]`, `fused[bt32]`)
SWEEP = {
    "k2-bn64-bt64": (dict(BN=64, BT=64, BK=256, num_warps=4, num_stages=3), None),
    "shrink-bt128": (None, dict(BT=128, BK=64, num_warps=8, num_stages=3)),
    "shrink-bk128": (None, dict(BT=64, BK=128, num_warps=4, num_stages=3)),
}
TENANTS = [1, 8, 32]
DEV = "cuda"  # tests run the script's logic on CPU (Triton's interpreter) by setting "cpu"


def build_layer(T: int, seed: int = 0):
    """FP8 codes of each projection and T random adapters per slice (vLLM's per-slice slot layout)."""
    from epirl.kernels import quantize_weight_fp8

    layer, g = [], torch.Generator(device=DEV).manual_seed(seed)
    for name, K, N in LAYER:
        codes, scale = quantize_weight_fp8(torch.randn(N, K, device=DEV, generator=g) * 0.02)
        a = [(torch.randn(T, RANK, K, device=DEV, generator=g) / K ** 0.5).bfloat16() for _ in SLICES[name]]
        b = [(torch.randn(T, w, RANK, device=DEV, generator=g) * 0.02).bfloat16() for w in SLICES[name]]
        layer.append(dict(name=name, K=K, N=N, codes=codes, scale=scale, a=a, b=b, widths=SLICES[name],
                          scale_b=scale.float().reshape(1, 1).expand(1, N).contiguous()))
    return layer


def prefill_path(x, p, ids, k2_config=None, shrink="grouped", shrink_config=None):
    """The fused prefill path built from its pieces: quantize, the shrink, K2 (None configs: the defaults).
    shrink "grouped": the grouped tensor-core shrink + one chunk sum (the path as it is); "k1": K1's per-token
    shrink with K2 summing the chunk partials in every weight tile (the path before the grouped shrink)."""
    from epirl.kernels.fp8_quant.triton import quantize_per_token
    from epirl.kernels.w8a8_multi.triton import (PREFILL_CONFIG, Slices, adapter_order, grouped_shrink,
                                                      multi_lora_gemm, quant_shrink, sum_chunks)

    k2 = k2_config or PREFILL_CONFIG
    slices = Slices(p["a"], p["b"], p["widths"])
    q, s = quantize_per_token(x)
    order = adapter_order(ids, min(k2["BT"], (shrink_config or {}).get("BT", k2["BT"])))
    if shrink == "k1":
        part = quant_shrink(x, slices, ids, quant=False)[2]
    else:
        part = sum_chunks(grouped_shrink(x, slices, ids, order, config=shrink_config))
    y = torch.empty(x.shape[0], p["N"], device=DEV, dtype=torch.bfloat16)
    return multi_lora_gemm(q, p["codes"], p["scale"].float().reshape(1), y, ids, part, slices, SIGMA,
                           x_scale=s.reshape(-1), order=order, config=k2)


def variants(layer, M: int, T: int, sweep: bool = False):
    """{variant: fn computing the whole layer}; the inputs are built here, outside any graph."""
    from epirl.kernels.w8a8_multi.segmented import expand_segments, segments
    from epirl.kernels.w8a8_multi.timing import spread_adapters, vendor_base
    from epirl.kernels.w8a8_multi.triton import adapter_order, expand_into, w8a8_multi_lora_slices

    xs = {p["K"]: torch.randn(M, p["K"], device=DEV, dtype=torch.bfloat16) for p in layer}
    ids = spread_adapters(M, T).to(DEV)  # evenly over min(T, M) adapters, random order (as the dispatch times)

    def each(fn):
        return lambda: [fn(p, xs[p["K"]]) for p in layer]

    out = {
        "base": each(lambda p, x: vendor_base(x, p["codes"], p["scale_b"])),
        "fused": each(lambda p, x: w8a8_multi_lora_slices(x, p["codes"], p["scale"], p["a"], p["b"], p["widths"],
                                                          ids, SIGMA)),
        "fused-k1": each(lambda p, x: prefill_path(x, p, ids, shrink="k1")),
        "vendor+epirl": each(lambda p, x: expand_into(vendor_base(x, p["codes"], p["scale_b"]), x, p["a"], p["b"],
                                                      ids, SIGMA, order=adapter_order(ids, 128), widths=p["widths"])),
    }
    segs = segments(ids, T)
    out["vendor+seg"] = each(lambda p, x: expand_segments(vendor_base(x, p["codes"], p["scale_b"]), x, p["a"], p["b"],
                                                          segs, SIGMA, widths=p["widths"]))
    if sweep:
        from epirl.kernels.w8a8_multi.triton import PREFILL_VARIANTS

        sweep_tiles = {**{f"k2-{tag}": (cfg, None) for tag, cfg in PREFILL_VARIANTS.items()}, **SWEEP}
        for tag, (k2, shrink) in sweep_tiles.items():
            out[f"fused[{tag}]"] = each(lambda p, x, k2=k2, sc=shrink: prefill_path(x, p, ids, k2, shrink_config=sc))
    if DEV != "cuda":  # vLLM's LoRA kernels are Triton kernels vLLM launches on GPUs only
        return out, xs, ids
    try:
        from epirl.engine.vllm_compat.punica import punica_lora_adder

        adders = {p["name"]: punica_lora_adder(xs[p["K"]], p["a"], p["b"], ids, SIGMA) for p in layer}
        out["vendor+vllm"] = each(lambda p, x: adders[p["name"]](vendor_base(x, p["codes"], p["scale_b"])))
    except ImportError as exc:
        print(f"# vendor+vllm skipped: {exc}", flush=True)
    return out, xs, ids


def reference_rows(layer, xs, ids, rows: int = 16):
    """(picked token rows, float64-accumulated reference outputs of each projection on them): computed once per
    batch and shared by every variant's check."""
    from epirl.kernels import w8a8_multi_lora

    pick = torch.randperm(ids.shape[0], device=DEV)[:rows]
    refs = []
    for p in layer:
        x, start, parts = xs[p["K"]][pick].cpu(), 0, []
        for w, a, b in zip(p["widths"], p["a"], p["b"]):
            parts.append(w8a8_multi_lora(x, p["codes"][start:start + w].cpu(), p["scale"].cpu(), a.cpu(), b.cpu(),
                                         ids[pick].cpu(), SIGMA, backend="reference").float())
            start += w
        refs.append(torch.cat(parts, dim=1))
    return pick, refs


def max_error(outs, pick, refs) -> float:
    """max |Δ| / mean |y| of one call's outputs (one per projection) vs the reference rows."""
    return max(((y[pick].float().cpu() - ref).abs().max() / ref.abs().mean()).item() for y, ref in zip(outs, refs))


def run(tokens, tenants, timer=None, sweep: bool = False):
    """One row per (tenants, tokens); timer: µs of one fn (default: CUDA-graph replay, L2 flushed)."""
    if timer is None:
        from epirl.kernels.gpu_timing import graph_us as timer
    rows = []
    for T in tenants:
        layer = build_layer(T)
        for M in tokens:
            fns, xs, ids = variants(layer, M, T, sweep)
            pick, refs = reference_rows(layer, xs, ids)
            row = dict(M=M, T=T)
            for name, fn in fns.items():
                try:
                    row[name] = timer(fn)
                    if name != "base":
                        row[f"{name}_err"] = max_error(fn(), pick, refs)
                except Exception as exc:  # e.g. a swept tile that does not fit: report it, measure the rest
                    row[name] = row[f"{name}_err"] = float("nan")
                    print(f"# {name} at M={M}, T={T} failed: {str(exc).splitlines()[0][:160]}", flush=True)
            rows.append(row)
            print("# " + ", ".join(f"{k}={v:.4g}" for k, v in row.items()), flush=True)
    return rows


def print_table(rows):
    names = [n for n in ("vendor+vllm", "fused", "fused-k1", "vendor+epirl", "vendor+seg") if n in rows[0]]
    names += sorted(n for n in rows[0] if n.startswith("fused[") and not n.endswith("_err"))
    ref = "vendor+vllm" if "vendor+vllm" in rows[0] else "base"
    print("\n| tokens | tenants | base µs | " + " | ".join(f"{n} µs (×{ref})" for n in names)
          + " | max err / mean abs y |\n|---|---|---|" + "---|" * (len(names) + 1))
    for r in rows:
        cells = " | ".join(f"{r[n]:.1f} ({r[n] / r[ref]:.3f})" for n in names)
        err = max((r[f"{n}_err"] for n in names if r[f"{n}_err"] == r[f"{n}_err"]), default=float("nan"))
        print(f"| {r['M']} | {r['T']} | {r['base']:.1f} | {cells} | {err:.2e} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    ap.add_argument("--tenants", type=int, nargs="+", default=TENANTS)
    ap.add_argument("--sweep", action="store_true", help="also the fused path with other K2 / shrink tiles")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_serving_tenants needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = run(args.tokens, args.tenants, sweep=args.sweep)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
