"""GPU evidence for `epirl mismatch` on SmolLM2 with bf16, W8A8 (vLLM's own FP8) and matched
W8A16 engines on an H200, printed as the Markdown table for BENCHMARKS.md § Mismatch.

    python scripts/offline/gpu_mismatch.py --out $OUT/mismatch          # full run (128 prompts × 4 samples)
    python scripts/offline/gpu_mismatch.py --quick --out $OUT/mismatch  # 16 prompts × 2 samples, 128 tokens
    python scripts/offline/gpu_mismatch.py --random-adapter 0.02 ...    # a random rank-r adapter on every projection

Needs CUDA and a vLLM with the epirl plugin (scripts/offline/README.md: staging). Writes mismatch.json,
mismatch.png and mismatch.md under --out; exit status is the command's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def random_adapter(args, folder: Path) -> str:
    """A PEFT adapter folder for --model with the config's default rank and targets: A ~ N(0, 1/K), B ~ N(0, std²)
    (a trained adapter's B is not zero; a fresh one's is, and would leave the LoRA kernels nothing to add)."""
    import torch

    from epirl.config import load_config
    from epirl.model import load_policy
    from epirl.model.adapter_io import save_adapter

    cfg = load_config(None, [f"model.dtype={args.dtype}"])
    cfg.model.path = args.model
    policy = load_policy(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(v.shape, generator=g) / v.shape[-1] ** 0.5 if "lora_A" in k
                 else torch.randn(v.shape, generator=g) * args.random_adapter)
             for k, v in policy.lora_state_dict().items()}
    policy.load_lora_state_dict(state)
    return str(save_adapter(policy, folder, cfg))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs") + "/mismatch")
    parser.add_argument("--quick", action="store_true", help="16 prompts × 2 samples, 128 tokens")
    parser.add_argument("--engines", default="bf16,w8a8,w8a16")
    parser.add_argument("--eager", action="store_true",
                        help="engines without torch.compile / CUDA graphs (starts in ~15 s instead of ~60-90 s; "
                             "the engine's kernels then differ from a graph-captured run's fused ones)")
    parser.add_argument("--dtype", default="bfloat16", help="model.dtype for engines and trainer")
    parser.add_argument("--random-adapter", type=float, default=0.0, metavar="STD",
                        help="measure with a random LoRA adapter (A ~ N(0, 1/K), B ~ N(0, STD²), lora.* defaults) "
                             "written under --out: the engines' LoRA kernels then serve every step (0: none)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    if not torch.cuda.is_available():
        print("gpu_mismatch.py: needs CUDA", file=sys.stderr)
        return 2
    from epirl.cli import main as epirl_main
    from epirl.mismatch.report import markdown_table

    sizes = ["--n-prompts", "16", "--samples", "2", "--max-tokens", "128"] if args.quick else \
        ["--n-prompts", "128", "--samples", "4", "--max-tokens", "256"]
    adapter = ["--adapter", random_adapter(args, Path(args.out) / "adapter")] if args.random_adapter else []
    argv = ["mismatch", "--model", args.model, "--engines", args.engines, "--out", args.out, *sizes, *adapter,
            f"model.dtype={args.dtype}", "engine.gpu_memory_utilization=0.35",
            f"engine.enforce_eager={str(args.eager).lower()}"]
    t0 = time.perf_counter()
    status = epirl_main(argv)
    if status != 0:
        return status
    summary = json.loads((Path(args.out) / "mismatch.json").read_text())
    flags = (f"{' --quick' if args.quick else ''}{' --eager' if args.eager else ''}"
             f"{f' --random-adapter {args.random_adapter}' if args.random_adapter else ''} --engines {args.engines}")
    header = (f"{time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, "
              f"`python scripts/offline/gpu_mismatch.py{flags}` ({time.perf_counter() - t0:.0f} s)")
    table = markdown_table(summary)
    (Path(args.out) / "mismatch.md").write_text(header + "\n\n" + table + "\n")
    print(header)
    print(table)
    for note in summary.get("notes", []):
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
