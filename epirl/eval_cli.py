"""`epirl eval`: evaluate a base model and/or PEFT adapters on OlympiadBench, Minerva, MATH-500 and the
arithmetic training task.

    epirl eval --model Qwen/Qwen3-8B --adapter runs/a/adapter --adapter runs/b/adapter \\
               --benchmarks olympiadbench,minerva=data/minerva.jsonl --samples 1 --out eval_out
    epirl eval --model smollm2 --adapter runs/smollm2_arith_cpu/adapter --benchmarks arithmetic --limit 200

Without ``--adapter`` the base model is evaluated; two adapters are compared pairwise (McNemar).
The math benchmarks ask for the answer in \\boxed{} and grade the last box. `arithmetic` is the training
task itself: with the run's config.yaml beside the adapter (runs/<name>/adapter or a checkpoint's adapter),
its problems, prompt and answer grading (reward.style) are the run's own.
Bad input (unknown benchmark, missing file or folder, impossible settings) prints one line naming the
flag or file and exits with code 2 before any model is loaded. The terminal shows the plan, a progress bar and
the results; what vLLM and other libraries print goes to OUT/eval.log (--verbose: to the terminal too). A
crash moves a new OUT to OUT.failed and prints the end of its log.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from rich.markup import escape

from epirl import hub
from epirl.config import ENGINE_PRECISIONS, MODEL_ALIASES, ConfigError, EpirlConfig, load_config
from epirl.console import (DefaultsHelpFormatter, RunOutput, add_verbose_arg, error_line, plan_line,
                           quiet_library_environment, run_in_folder, verbose_requested)
from epirl.data import DataError
from epirl.eval.benchmarks import (BENCHMARK_NAMES, TrainingTask, load_benchmark, local_file_columns,
                                   parse_benchmark_list)
from epirl.eval.runner import EvalSettings, Variant, run_eval
from epirl.plan import installed_vllm, model_row
from epirl.rewards import RewardPool

log = logging.getLogger(__name__)

PROMPT_ROOM_TOKENS = 2048  # default room for the prompt on top of --max-tokens (sets max_model_len)


class EvalUsageError(ValueError):
    """Bad command-line input; the message names the flag or file."""


def add_eval_args(subparsers) -> argparse.ArgumentParser:
    """Register the ``eval`` subcommand on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "eval", help="evaluate a model / adapters on math benchmarks",
        description=__doc__, formatter_class=DefaultsHelpFormatter,
        epilog="local benchmark files (name=FILE: .jsonl, .json or .parquet, one problem per row) need the columns\n"
               + "\n".join(f"  {line}" for line in local_file_columns()),
    )
    parser.add_argument("--model", required=True, help="hub id, local folder, or alias (smollm2); required")
    parser.add_argument("--adapter", action="append", default=[], metavar="DIR",
                        help="PEFT adapter folder; repeat to compare (two adapters: paired McNemar test) "
                             "(default: none, the base model is evaluated)")
    parser.add_argument("--benchmarks", default="olympiadbench,minerva,math500",
                        help=f"comma-separated names ({', '.join(BENCHMARK_NAMES)}); a math benchmark may be "
                             "name=local.jsonl|parquet (columns below)")
    parser.add_argument("--samples", type=int, default=1, help="completions per problem (avg@k, pass@k)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (needs --samples 1)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    parser.add_argument("--engine", default="bf16", help=f"engine precision: {' | '.join(ENGINE_PRECISIONS)}")
    parser.add_argument("--max-tokens", type=int, default=2048, help="longest completion (tokens)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help=f"engine context length (default: --max-tokens + {PROMPT_ROOM_TOKENS})")
    parser.add_argument("--limit", type=int, default=None,
                        help="first N problems of each benchmark (default: all)")
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                        help="chat-template enable_thinking (Qwen3/3.5)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--reward-workers", type=int, default=2, help="grading processes")
    parser.add_argument("--reward-timeout", type=float, default=5.0, help="seconds per graded answer")
    parser.add_argument("--out", default=None, help="output folder (default: runs/eval-<time>)")
    parser.add_argument("--wandb", default="disabled", choices=("disabled", "offline", "online"),
                        help="log summary + failure table to a W&B run")
    add_verbose_arg(parser, "OUT/eval.log")
    parser.set_defaults(func=run_eval_command)
    return parser


def _adapter_lora(adapter_dir: str) -> tuple[int, float]:
    """(r, lora_alpha) of a PEFT folder: the engine's adapter slot must hold it (w8a16 fixes σ = alpha/r too)."""
    # deferred: epirl.model loads transformers, which `epirl eval --help` and argument errors need not
    from epirl.model.adapter_io import AdapterConfigError, read_adapter_settings
    from epirl.model.dummy import refuse_random_weights

    try:
        settings = read_adapter_settings(adapter_dir)
        refuse_random_weights(adapter_dir, "--adapter")
    except AdapterConfigError as exc:
        raise EvalUsageError(f"--adapter: {exc}") from None
    except ConfigError as exc:
        raise EvalUsageError(str(exc)) from None
    return settings.rank, settings.alpha


def _check_model(model: str) -> None:
    looks_local = model.startswith((".", "/", "~")) or model.count("/") != 1
    if model not in MODEL_ALIASES and looks_local and not Path(model).expanduser().is_dir():
        raise EvalUsageError(f"--model: '{model}' is not a folder, a hub id (org/name) or an alias {MODEL_ALIASES}")
    if model not in MODEL_ALIASES and hub.local_path(model) is None:  # offline: one line, not a minute of retries
        hub.require_hub("--model", model, EvalUsageError)


def training_config_file(adapter_dir: str) -> Path | None:
    """The config.yaml of the run that wrote an adapter: beside `runs/<name>/adapter`, or two folders up from a
    checkpoint's `runs/<name>/checkpoints/step_N/adapter`; None when there is none."""
    adapter = Path(adapter_dir)
    candidates = [adapter.parent / "config.yaml"]
    if adapter.parent.parent.name == "checkpoints":
        candidates.append(adapter.parents[2] / "config.yaml")
    return next((path for path in candidates if path.is_file()), None)


def training_task(adapter_dir: str) -> TrainingTask | None:
    """What the adapter was trained on, from its run's config.yaml; None without one. A config that no longer
    loads is named in one warning and ignored: grading then follows each benchmark's own answer format."""
    path = training_config_file(adapter_dir)
    if path is None:
        return None
    try:
        return TrainingTask.from_config(load_config(path), str(path))
    except ConfigError as exc:
        log.warning("--adapter %s: %s not used (%s)", adapter_dir, path, exc)
        return None


def _check_out(out: str | None) -> None:
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise EvalUsageError(f"--out {out}: is a file, not a folder")


def _variant_labels(adapters: list[str]) -> list[str]:
    """Short labels (folder names); the full path where two folders share a name."""
    names = [Path(a).name or a for a in adapters]
    return [name if names.count(name) == 1 else adapter for name, adapter in zip(names, adapters)]


def validate_args(args: argparse.Namespace):
    """Everything that can be checked before loading a model; raises EvalUsageError (one line)."""
    if args.engine not in ENGINE_PRECISIONS:
        raise EvalUsageError(f"--engine must be one of {', '.join(ENGINE_PRECISIONS)}, got '{args.engine}'")
    for flag, value, minimum in (("--samples", args.samples, 1), ("--max-tokens", args.max_tokens, 1),
                                 ("--reward-workers", args.reward_workers, 1)):
        if value < minimum:
            raise EvalUsageError(f"{flag} must be >= {minimum}, got {value}")
    if args.limit is not None and args.limit < 1:
        raise EvalUsageError(f"--limit must be >= 1, got {args.limit}")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.reward_timeout <= 0:
        raise EvalUsageError("--temperature must be >= 0, --top-p in (0, 1], --reward-timeout > 0")
    if args.samples > 1 and args.temperature == 0:
        raise EvalUsageError(f"--samples {args.samples} needs --temperature > 0 (greedy decoding repeats itself)")
    max_model_len = args.max_model_len or args.max_tokens + PROMPT_ROOM_TOKENS
    if max_model_len <= args.max_tokens:
        raise EvalUsageError(f"--max-model-len ({max_model_len}) must exceed --max-tokens ({args.max_tokens})")
    _check_model(args.model)
    _check_out(args.out)
    loras = [_adapter_lora(adapter) for adapter in args.adapter]
    if args.engine == "w8a16" and len(set(loras)) > 1:
        # The matched engine sizes its fused LoRA buffers and σ = alpha/r once, at start.
        raise EvalUsageError(f"--engine w8a16 serves one LoRA shape, the adapters have (r, alpha) = {sorted(set(loras))}; "
                             "compare them with --engine bf16 or w8a8")
    trainings = [training_task(adapter) for adapter in args.adapter]
    # The arithmetic benchmark is one problem list for every variant: the first adapter's training run's.
    first_training = next((task for task in trainings if task is not None), None)
    try:
        benchmarks = [load_benchmark(name, path, args.limit, first_training)
                      for name, path in parse_benchmark_list(args.benchmarks)]
    except DataError as error:
        raise EvalUsageError(f"--benchmarks: {error}") from None
    settings = EvalSettings(samples=args.samples, temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, thinking=args.thinking, seed=args.seed,
                            max_model_len=max_model_len)
    if args.adapter:
        variants = [Variant(label, adapter, training=training)
                    for label, adapter, training in zip(_variant_labels(args.adapter), args.adapter, trainings)]
    else:
        variants = [Variant("base")]
    # The slot holds the largest rank (vLLM's own LoRA path reads each adapter's alpha from its file).
    return settings, benchmarks, variants, max(loras, default=None)


def build_engine_config(args: argparse.Namespace, max_model_len: int, adapter_lora: tuple[int, float] | None):
    """The EpirlConfig the engine is built from (model, precision, context, adapter slot size)."""
    from pydantic import ValidationError

    tree = {"seed": args.seed, "model": {"path": args.model, "max_model_len": max_model_len, "thinking": args.thinking},
            "engine": {"precision": args.engine}}
    if adapter_lora is not None:
        tree["lora"] = {"rank": adapter_lora[0], "alpha": adapter_lora[1]}
    try:
        return EpirlConfig.model_validate(tree)
    except ValidationError as error:
        first = error.errors()[0]
        raise EvalUsageError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def _start_wandb(mode: str, args: argparse.Namespace) -> None:
    if mode == "disabled":
        return
    import wandb

    wandb.init(project="epirl", job_type="eval", mode=mode, config=vars(args) | {"func": None})


def run_eval_command(args: argparse.Namespace) -> int:
    """Entry point of ``epirl eval``; returns the process exit code."""
    verbose = verbose_requested(args)
    quiet_library_environment()
    with RunOutput(None, verbose) as checking:  # no folder yet: bad input leaves nothing behind
        try:
            settings, benchmarks, variants, adapter_lora = validate_args(args)
            cfg = build_engine_config(args, settings.max_model_len, adapter_lora)
        except (EvalUsageError, ValueError) as error:
            error_line(checking.console, str(error))
            return 2
    out_dir = Path(args.out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")

    def evaluate(out: RunOutput) -> int:
        _print_plan(out, cfg, settings, benchmarks, variants, out_dir)
        _evaluate(args, cfg, settings, benchmarks, variants, out_dir, out)
        out.console.print(f"[green]wrote[/] {escape(str(out_dir / 'eval.json'))} and records.jsonl",
                          soft_wrap=True, highlight=False)
        return 0

    return run_in_folder(out_dir, "eval.log", verbose, log, evaluate)


def _print_plan(out: RunOutput, cfg, settings, benchmarks, variants, out_dir: Path) -> None:
    """What will run, before the engine starts: output folder, model, engine, variants × benchmarks."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # vLLM's platform (model.dtype auto stays vLLM's)

    sampling = ("greedy" if settings.temperature == 0 else
                f"temperature {settings.temperature:g}, top-p {settings.top_p:g}")
    what = ", ".join(variant.label for variant in variants)
    on = ", ".join(f"{benchmark.name} ({len(benchmark.problems)} problems)" for benchmark in benchmarks)
    rows = [("run", f"{out_dir}  (log: {out_dir / 'eval.log'})"), model_row(cfg),
            ("engine", f"vLLM {installed_vllm()} {cfg.engine.precision} on {device}"
                       + (f", LoRA slot r{cfg.lora.rank}" if any(v.adapter_dir for v in variants) else "")),
            ("eval", f"{what} on {on}: {settings.samples} sample(s) per problem, {sampling}, ≤ {settings.max_tokens} "
                     "tokens" + (", thinking" if settings.thinking else ""))]
    for label, text in rows:
        plan_line(out.console, label, text, log)


def _evaluate(args, cfg, settings, benchmarks, variants, out_dir: Path, out: RunOutput) -> None:
    # deferred: epirl.engine loads transformers (and vLLM when it starts)
    from epirl.engine import RolloutEngine

    _start_wandb(args.wandb, args)
    # The pool first: its fork server starts before vLLM creates threads in this process.
    with RewardPool(workers=args.reward_workers, timeout_s=args.reward_timeout) as pool:
        engine = RolloutEngine(cfg)
        try:
            run_eval(engine, pool, benchmarks, settings, variants, out_dir, console=out.console)
        finally:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
    if args.wandb != "disabled":
        import wandb

        wandb.finish()
