"""`epirl mismatch` command line (arguments, engine loop, outputs); what it measures is the package docstring
(`epirl.mismatch`).

    epirl mismatch --model smollm2 --engines bf16,w8a8,w8a16 --n-prompts 32 --samples 4 --out runs/mm
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

from rich.console import Console
from transformers import AutoTokenizer

from epirl.config import ENGINE_PRECISIONS, ConfigError, load_config, resolve_runtime
from epirl.data import DataError, load_problems, render_prompt
from epirl.engine.engine import check_vllm_args
from epirl.mismatch.measure import measure_engines
from epirl.mismatch.report import log_wandb, render_tables, write_chart, write_json
from epirl.model.loading import local_model_dir

log = logging.getLogger(__name__)
# vLLM's default `max_logprobs` (the engine does not raise it): the most alternatives it returns per token.
MAX_TOPK = 20


class MismatchInputError(ValueError):
    """Bad command-line input: reported as one line, exit status 2."""


def add_mismatch_args(subparsers) -> argparse.ArgumentParser:
    """Register the `mismatch` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser("mismatch", help="δW/δA/δK decomposition of the engine–trainer mismatch",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="hub id, local folder, or alias (smollm2)")
    parser.add_argument("--adapter", default=None, metavar="DIR", help="PEFT LoRA adapter folder (engine + trainer)")
    parser.add_argument("--prompts", default="arithmetic",
                        help="arithmetic (offline, generated), a hub dataset id, or a .jsonl/.json/.parquet file")
    parser.add_argument("--n-prompts", type=int, default=128)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--engines", default="bf16,w8a8,w8a16",
                        help="comma-separated engine precisions; w8a8 is vLLM's W8A8 engine with its own LoRA kernels, "
                             "w8a8@timed / w8a8@fused the W8A8 engine with epirl's serving kernels (what "
                             "`epirl train` uses by default on CUDA: engine.serving_kernels=auto)")
    parser.add_argument("--topk", type=int, default=20,
                        help=f"engine log-probs per position for the KL (top-k + tail bucket; ≤ {MAX_TOPK})")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates (over prompts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="output folder (default: runs/mismatch-<time>)")
    parser.add_argument("--wandb", default="disabled", choices=("disabled", "offline", "online"))
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value (e.g. model.dtype=bfloat16)")
    parser.set_defaults(func=run_mismatch_command)
    return parser


SERVING_SPECS = ("w8a8@fused", "w8a8@timed")  # the W8A8 engine with epirl's serving kernels (serving_lora)


def parse_engines(text: str) -> list[str]:
    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINE_PRECISIONS and e not in SERVING_SPECS]
    if not engines or unknown:
        raise MismatchInputError(f"--engines: unknown engine precision(s) {unknown or [text]}; "
                                 f"choose from {','.join(ENGINE_PRECISIONS + SERVING_SPECS)}")
    if len(set(engines)) != len(engines):
        raise MismatchInputError(f"--engines: {text!r} lists an engine twice")
    return engines


def adapter_settings(adapter: str | None) -> dict:
    """rank / alpha / targets of a PEFT adapter folder (the engine slot and the policies must match it)."""
    if adapter is None:
        return {}
    from epirl.model.adapter_io import AdapterConfigError, read_adapter_settings

    try:
        settings = read_adapter_settings(adapter)
    except AdapterConfigError as exc:
        raise MismatchInputError(f"--adapter: {exc}") from None
    return {"rank": settings.rank, "alpha": settings.alpha, "targets": settings.targets}


def _check_numbers(args) -> None:
    for name in ("n_prompts", "samples", "max_tokens", "bootstrap"):
        if getattr(args, name) < 1:
            raise MismatchInputError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if not 1 <= args.topk <= MAX_TOPK:
        raise MismatchInputError(f"--topk must be in 1..{MAX_TOPK} (vLLM's max_logprobs), got {args.topk}")
    if args.temperature <= 0:
        raise MismatchInputError(f"--temperature must be > 0 (log-probs of sampled tokens), got {args.temperature}")


def build_config(args, lora: dict):
    """EpirlConfig for the measurement: overrides, then the command's own options."""
    try:
        cfg = load_config(None, list(args.overrides))
        check_vllm_args(cfg)
    except ConfigError as exc:
        raise MismatchInputError(str(exc)) from None
    cfg.model.path = args.model
    cfg.seed = args.seed
    cfg.data.source = args.prompts
    # The measurement starts one engine per precision in this process; vLLM's sleep-mode allocator
    # (used for KV release) allows one instance per process (seen on 0.26), and nothing trains here.
    cfg.engine.kv_release = False
    if lora:
        cfg.lora.rank, cfg.lora.alpha = lora["rank"], lora["alpha"]
        if lora["targets"]:
            cfg.lora.targets = lora["targets"]
    return cfg


def load_prompt_ids(cfg, tokenizer, n_prompts: int, seed: int) -> list[list[int]]:
    """Token ids of `n_prompts` chat prompts from `data.source` (a seeded subset when there are more)."""
    try:
        problems = load_problems(cfg.data, seed)
    except DataError as exc:
        raise MismatchInputError(f"--prompts: {exc}") from None
    if len(problems) > n_prompts:
        keep = sorted(random.Random(seed).sample(range(len(problems)), n_prompts))
        problems = [problems[i] for i in keep]
    return [render_prompt(tokenizer, p.messages, cfg.model.thinking) for p in problems]


def _prepare(args):
    """Validate input and build (cfg, device, prompt ids, engines, adapter dir); MismatchInputError on bad input."""
    engines = parse_engines(args.engines)
    _check_numbers(args)
    lora = adapter_settings(args.adapter)
    cfg = build_config(args, lora)
    try:
        model_dir = local_model_dir(cfg.model.path)
    except Exception as exc:  # unknown hub id, offline, missing folder: one line
        raise MismatchInputError(f"--model {args.model}: {type(exc).__name__}: {exc}") from None
    device = resolve_runtime(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = load_prompt_ids(cfg, tokenizer, args.n_prompts, args.seed)
    if not prompt_ids:
        raise MismatchInputError(f"--prompts {args.prompts}: no prompts")
    longest = max(len(p) for p in prompt_ids) + args.max_tokens
    cfg.model.max_model_len = max(64, -(-longest // 64) * 64)
    return cfg, device, prompt_ids, engines


def run_mismatch_command(args: argparse.Namespace) -> int:
    """`epirl mismatch ...`: measure, print, write mismatch.json / mismatch.png, W&B. Returns the exit status."""
    console = Console()
    if not console.is_terminal:  # piped / logged: rich would wrap the tables at 80 columns
        console = Console(width=200)
    try:
        cfg, device, prompt_ids, engines = _prepare(args)
    except MismatchInputError as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}", soft_wrap=True)
        return 2
    out_dir = Path(args.out or f"runs/mismatch-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    summary, _ = measure_engines(cfg, prompt_ids, engines, args.samples, args.max_tokens, args.temperature,
                                 args.topk, args.seed, device, args.adapter, args.bootstrap)
    summary["settings"] = {"model": args.model, "adapter": args.adapter, "prompts": args.prompts,
                           "n_prompts": len(prompt_ids), "samples": args.samples, "max_tokens": args.max_tokens,
                           "temperature": args.temperature, "topk": args.topk, "engines": engines,
                           "seed": args.seed, "dtype": cfg.model.dtype, "device": str(device),
                           "wall_s": round(time.perf_counter() - t0, 1)}
    render_tables(summary, console)
    json_path = write_json(summary, out_dir)
    chart_path = write_chart(summary, out_dir)
    log_wandb(summary, chart_path, args.wandb, cfg.tracking.project, f"mismatch-{args.model}", out_dir)
    console.print(f"[green]wrote[/] {json_path} and {chart_path}")
    return 0
