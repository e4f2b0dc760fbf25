"""`epirl mismatch` command line (arguments, engine loop, outputs); what it measures is the package docstring
(`epirl.mismatch`).

    epirl mismatch --model smollm2 --engines bf16,w8a8,w8a16 --n-prompts 32 --samples 4 --out runs/mm

The terminal shows the plan, a progress bar (one step per engine, one for the trainer variants) and the tables
(on standard output); what vLLM and other libraries print goes to OUT/mismatch.log (--verbose: to the terminal
too). Bad input is one line and exit code 2 before any engine starts; a crash moves a new OUT to OUT.failed
and prints the end of its log.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from transformers import AutoTokenizer

from epirl import hub
from epirl.config import ENGINE_PRECISIONS, MODEL_ALIASES, ConfigError, first_line, load_config, resolve_runtime
from epirl.console import (DefaultsHelpFormatter, RunOutput, add_verbose_arg, error_line, plan_line,
                           quiet_library_environment, run_in_folder, verbose_requested)
from epirl.data import DataError, load_problems, render_prompt
from epirl.engine.engine import check_vllm_args
from epirl.mismatch.measure import measure_engines
from epirl.mismatch.report import log_wandb, render_tables, write_chart, write_json
from epirl.mismatch.variants import VARIANTS
from epirl.model.adapter_io import AdapterConfigError, read_adapter_settings
from epirl.model.loading import local_model_dir
from epirl.plan import installed_vllm, model_row
from epirl.progress import PhaseProgress

log = logging.getLogger(__name__)
# vLLM's default `max_logprobs` (the engine does not raise it): the most alternatives it returns per token.
MAX_TOPK = 20


class MismatchInputError(ValueError):
    """Bad command-line input: reported as one line, exit status 2."""


def add_mismatch_args(subparsers) -> argparse.ArgumentParser:
    """Register the `mismatch` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser("mismatch", help="δW/δA/δK decomposition of the engine–trainer mismatch",
                                   description=__doc__, formatter_class=DefaultsHelpFormatter,
                                   epilog="local prompt files (.jsonl, .json or .parquet, one prompt per row) need "
                                          "the columns\n" + "\n".join(f"  {line}" for line in PROMPT_FILE_COLUMNS))
    parser.add_argument("--model", default="smollm2", help="hub id, local folder, or alias (smollm2)")
    parser.add_argument("--adapter", default=None, metavar="DIR",
                        help="PEFT LoRA adapter folder (engine + trainer) (default: none, the base model)")
    parser.add_argument("--prompts", default="arithmetic",
                        help="arithmetic (offline, generated), a hub dataset id, or a .jsonl/.json/.parquet file "
                             "(columns below)")
    parser.add_argument("--n-prompts", type=int, default=128, help="prompts measured (a seeded subset of the source)")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest completion (tokens)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    parser.add_argument("--engines", default="bf16,w8a8,w8a16",
                        help="comma-separated engine precisions; w8a8 is vLLM's W8A8 engine with its own LoRA kernels, "
                             "w8a8@timed / w8a8@fused the W8A8 engine with epirl's serving kernels (what "
                             "`epirl train` uses by default on CUDA: engine.serving_kernels=auto), w8a16-bitwise the "
                             "matched engine with engine.bitwise (needs model.dtype=bfloat16)")
    parser.add_argument("--topk", type=int, default=20,
                        help=f"engine log-probs per position for the KL (top-k + tail bucket; ≤ {MAX_TOPK})")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates (over prompts)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt subset and of sampling")
    parser.add_argument("--out", default=None, help="output folder (default: runs/mismatch-<time>)")
    parser.add_argument("--wandb", default="disabled", choices=("disabled", "offline", "online"),
                        help="log the summary and chart to a W&B run")
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value, e.g. model.dtype=bfloat16 "
                                                     "(default: none; `epirl train --help-config` lists the keys)")
    add_verbose_arg(parser, "OUT/mismatch.log")
    parser.set_defaults(func=run_mismatch_command)
    return parser


SERVING_SPECS = ("w8a8@fused", "w8a8@timed")  # the W8A8 engine with epirl's serving kernels (serving_lora)
BITWISE_SPEC = "w8a16-bitwise"  # the matched engine with engine.bitwise (scored by the bitwise trainer variants)
# What epirl.data reads from a prompt file (data.format auto); --help names it.
PROMPT_FILE_COLUMNS = ("math: problem (or question), answer; optional: unique_id (or id)",
                       "dapo: prompt (a string or chat messages), reward_model.ground_truth")


def parse_engines(text: str) -> list[str]:
    engines = [e.strip() for e in text.split(",") if e.strip()]
    known = ENGINE_PRECISIONS + SERVING_SPECS + (BITWISE_SPEC,)
    unknown = [e for e in engines if e not in known]
    if not engines or unknown:
        raise MismatchInputError(f"--engines: unknown engine precision(s) {unknown or [text]}; "
                                 f"choose from {','.join(known)}")
    if len(set(engines)) != len(engines):
        raise MismatchInputError(f"--engines: {text!r} lists an engine twice")
    return engines


def adapter_settings(adapter: str | None) -> dict:
    """rank / alpha / targets of a PEFT adapter folder (the engine slot and the policies must match it)."""
    if adapter is None:
        return {}

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


def load_prompt_problems(cfg, n_prompts: int, seed: int) -> list:
    """`n_prompts` problems from `data.source` (a seeded subset when there are more)."""
    try:
        problems = load_problems(cfg.data, seed)
    except DataError as exc:
        raise MismatchInputError(f"--prompts: {str(exc).removeprefix('data.source: ')}") from None
    if not problems:
        raise MismatchInputError(f"--prompts {cfg.data.source}: no prompts")
    if len(problems) > n_prompts:
        keep = sorted(random.Random(seed).sample(range(len(problems)), n_prompts))
        problems = [problems[i] for i in keep]
    return problems


def _model_dir(model: str) -> Path:
    """The local folder of --model: a missing folder, or a hub id while the hub is unreachable, is one line at
    once (the hub client would retry for a minute)."""
    if model not in MODEL_ALIASES:
        local = hub.local_path(model)
        if local is None:
            hub.require_hub("--model", model, MismatchInputError)
        elif not local.is_dir():
            raise MismatchInputError(f"--model {model}: no such folder (a hub id is spelled org/name)")
    try:
        return local_model_dir(model)
    except Exception as exc:  # noqa: BLE001 - unknown hub id, a folder that is no model: one line
        raise MismatchInputError(f"--model {model}: {type(exc).__name__}: {first_line(exc)}") from None


def _prepare(args):
    """Validate input and build (cfg, device, prompt ids, engines, adapter dir); MismatchInputError on bad input."""
    engines = parse_engines(args.engines)
    _check_numbers(args)
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise MismatchInputError(f"--out {args.out}: is a file, not a folder")
    lora = adapter_settings(args.adapter)
    cfg = build_config(args, lora)
    try:
        device = resolve_runtime(cfg)
    except ConfigError as exc:
        raise MismatchInputError(str(exc)) from None
    if BITWISE_SPEC in engines and cfg.model.dtype != "bfloat16":
        raise MismatchInputError(f"--engines {BITWISE_SPEC}: needs model.dtype=bfloat16 (the run resolves to "
                                 f"{cfg.model.dtype}); add the override model.dtype=bfloat16")
    model_dir = _model_dir(args.model)
    problems = load_prompt_problems(cfg, args.n_prompts, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = [render_prompt(tokenizer, p.messages, cfg.model.thinking) for p in problems]
    longest = max(len(p) for p in prompt_ids) + args.max_tokens
    cfg.model.max_model_len = max(64, -(-longest // 64) * 64)
    return cfg, device, prompt_ids, engines


def run_mismatch_command(args: argparse.Namespace) -> int:
    """`epirl mismatch ...`: measure, print, write mismatch.json / mismatch.png, W&B. Returns the exit status."""
    verbose = verbose_requested(args)
    quiet_library_environment()
    with RunOutput(None, verbose) as checking:  # no folder yet: bad input leaves nothing behind
        try:
            cfg, device, prompt_ids, engines = _prepare(args)
        except MismatchInputError as exc:
            error_line(checking.console, str(exc))
            return 2
    out_dir = Path(args.out or f"runs/mismatch-{time.strftime('%Y%m%d-%H%M%S')}")

    def measure_and_report(out: RunOutput) -> int:
        _print_plan(out, args, cfg, device, len(prompt_ids), engines, out_dir)
        t0 = time.perf_counter()
        summary = _measure(cfg, prompt_ids, engines, args, device, out.console)
        summary["settings"] = {"model": args.model, "adapter": args.adapter, "prompts": args.prompts,
                               "n_prompts": len(prompt_ids), "samples": args.samples, "max_tokens": args.max_tokens,
                               "temperature": args.temperature, "topk": args.topk, "engines": engines,
                               "seed": args.seed, "dtype": cfg.model.dtype, "device": str(device),
                               "wall_s": round(time.perf_counter() - t0, 1)}
        # The tables are the result: standard output, as wide as they need when it is not a terminal.
        tables = Console(file=out.stdout)
        render_tables(summary, tables if tables.is_terminal else Console(file=out.stdout, width=200))
        json_path = write_json(summary, out_dir)
        chart_path = write_chart(summary, out_dir)
        log_wandb(summary, chart_path, args.wandb, cfg.tracking.project, f"mismatch-{args.model}", out_dir)
        out.console.print(f"[green]wrote[/] {escape(str(json_path))} and {chart_path.name}", soft_wrap=True,
                          highlight=False)
        return 0

    return run_in_folder(out_dir, "mismatch.log", verbose, log, measure_and_report)


def _print_plan(out: RunOutput, args, cfg, device, n_prompts: int, engines: list[str], out_dir: Path) -> None:
    variants = ", ".join(f"({name}) {text}" for name, text in VARIANTS.items())
    rows = [("run", f"{out_dir}  (log: {out_dir / 'mismatch.log'})"), model_row(cfg, args.adapter),
            ("engines", f"vLLM {installed_vllm()} {', '.join(engines)} on {device.type}, one at a time"),
            ("trainer", f"variants {variants} on {device.type}"),
            ("prompts", f"{n_prompts} from {args.prompts} × {args.samples} samples, ≤ {args.max_tokens} tokens, "
                        f"temperature {args.temperature:g}, top-{args.topk} log-probs, {args.bootstrap} bootstrap "
                        "replicates")]
    for label, text in rows:
        plan_line(out.console, label, text, log)


def _measure(cfg, prompt_ids: list[list[int]], engines: list[str], args, device, console: Console) -> dict:
    """`measure.measure_engines` with a progress bar: one phase per engine (started, sampled, closed), then the
    trainer variants' scoring and the bootstrap."""
    with PhaseProgress(console, "mismatch", len(engines) + 1) as phases:
        summary, _ = measure_engines(cfg, prompt_ids, engines, args.samples, args.max_tokens, args.temperature,
                                     args.topk, args.seed, device, args.adapter, args.bootstrap, phases=phases)
    return summary
