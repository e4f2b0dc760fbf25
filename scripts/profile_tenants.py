"""Where the multi-tenant LoRA time goes (H200): the variants of scripts/bench_serving_tenants.py on one Qwen3-8B layer
under torch.profiler, kernel by kernel (µs per layer call, from CUDA activity records), plus a memory-bound yardstick
(one bf16 read + write of every projection's output, what an expand after a vendor GEMM must move at least).
Extra variants: the segment-tiled path with other expand / shrink tiles, the chunks summed in the shrink, one run of
row tiles per slice.
Usage: python scripts/profile_tenants.py [--cases 8192:1 256:32 16:1] [--top 6]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving_tenants as tenants  # noqa: E402
from profile_trainer_linear import kernel_us_per_step  # noqa: E402

SEG_OPTIONS = {  # tag -> expand_segments keyword arguments; the dispatch's expand tiles are added from SEG_VARIANTS
    "seg[summed]": dict(sum_in_shrink=True),
    "seg[g1]": dict(groups=1),
    "seg[e-bt128w8]": dict(config=dict(BN=128, BT=128, num_warps=8, num_stages=2)),
    "seg[s-bt32]": dict(shrink_config=dict(BT=32, BK=64, num_warps=4, num_stages=3)),
}


def extra_variants(layer, xs, ids, T):
    from epirl.kernels.w8a8_multi_lora.segmented import SEG_VARIANTS, expand_segments, segments
    from epirl.kernels.w8a8_multi_lora.timing import vendor_base

    segs = segments(ids, T)
    ys = {p["name"]: vendor_base(xs[p["K"]], p["codes"], p["scale_b"]) for p in layer}
    out = {"y read+write": lambda: [ys[p["name"]].add_(1.0) for p in layer]}
    options = {**{f"seg[{tag}]": dict(config=cfg) for tag, cfg in SEG_VARIANTS.items()}, **SEG_OPTIONS}
    for tag, kw in options.items():
        out[tag] = lambda kw=kw: [expand_segments(ys[p["name"]], xs[p["K"]], p["a"], p["b"], segs, tenants.SIGMA,
                                                  widths=p["widths"], **kw) for p in layer]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["8192:1", "256:32", "16:1"], help="tokens:tenants")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_tenants needs a CUDA GPU", file=sys.stderr)
        return 2
    for case in args.cases:
        M, T = (int(v) for v in case.split(":"))
        layer = tenants.build_layer(T)
        fns, xs, ids = tenants.variants(layer, M, T)
        fns.update(extra_variants(layer, xs, ids, T))
        print(f"\n| {M} tokens, {T} tenants | kernel | µs per layer |\n|---|---|---|")
        seg = sorted(n for n in fns if n.startswith("seg["))
        for name in ("base", "y read+write", "vendor+vllm", "vendor+epirl", "vendor+seg", *seg, "fused"):
            if name not in fns:
                continue
            times, _ = kernel_us_per_step(fns[name], steps=3)
            total = sum(times.values())
            print(f"| **{name}** | (all) | **{total:.1f}** |")
            for kernel, us in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
                print(f"| {name} | {kernel[:70]} | {us:.1f} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
