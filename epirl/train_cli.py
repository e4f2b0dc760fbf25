"""`epirl train`: recipe + overrides → checked inputs → plan → the run, with a quiet console.

    epirl train recipes/smollm2_arith_cpu.yaml rl.steps=20 engine.precision=w8a16
    epirl train recipes/qwen35_9b_dapo.yaml --dry-run        # check data, model, vLLM args, memory; no training
    epirl train recipes/qwen35_9b_dapo.yaml --print-config   # the resolved config as YAML
    epirl train --resume runs/qwen35_9b_dapo                 # continue from the last checkpoint

Bad input (recipe, override, data, model, engine argument, memory plan, `--resume` folder) is one line on
the terminal and exit code 2, found before any engine starts, and leaves no run folder behind. Any other
failure before step 1 moves the new run folder to `runs/<name>.failed/` (its train.log shows why) and
prints the end of that log; a folder that existed before the command (resume) is never moved or removed.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import json
import logging
import os
import re
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Only what reading a recipe needs is imported here: a bad key, `--help` or `--print-config` answers in under a
# second. torch, vLLM, the model and the loop are imported by the functions that use them (seconds of import).
from epirl import hub
from epirl.config import (ConfigError, EpirlConfig, describe_fields, first_line, load_config, resolve_model_path,
                          resolve_runtime)
from epirl.console import (DefaultsHelpFormatter, RunOutput, add_verbose_arg, error_line, first_missing,
                           library_records_held, move_to_failed, plan_line, quiet_library_environment, remove_created,
                           show_failure, verbose_requested)
from epirl.cpu_threads import apply_thread_plan, plan_threads
from epirl.data import DataError

if TYPE_CHECKING:
    from epirl.rl.benchmark import BenchmarkSettings

log = logging.getLogger("epirl.train")


class InputError(Exception):
    """Bad input found before training: the message is the one line to show; exit code 2."""


def add_train_args(sub) -> None:
    train = sub.add_parser("train", help="colocated GRPO/DAPO training", description=__doc__,
                           formatter_class=DefaultsHelpFormatter)
    train.add_argument("recipe", nargs="?",
                       help="YAML recipe (see recipes/) (default: with --resume, the run's config.yaml)")
    train.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. rl.steps=5 (default: none)")
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue the run in RUN_DIR from its last checkpoint (default: a new run)")
    train.add_argument("--help-config", action="store_true",
                       help="print every config key (with the recipe's values when a recipe is given) and exit")
    train.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    train.add_argument("--dry-run", action="store_true",
                       help="check data, model, engine arguments and the memory plan, print the plan, and exit")
    add_verbose_arg(train, "runs/<name>/train.log")
    train.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                       type=str.upper, help="level of runs/<name>/train.log")
    train.add_argument("--benchmark", type=int, metavar="N", help="measure the real loop for N steps on synthetic "
                       "token-id prompts with seeded-coin rewards (no data, no checkpoints); writes benchmark.json "
                       "(default: off, a training run)")
    train.add_argument("--prompt-tokens", type=int, default=None, help="--benchmark prompt length (default: 256)")
    train.add_argument("--force-max-tokens", action="store_true", help="--benchmark: every response runs to rl.max_tokens")
    train.add_argument("--benchmark-out", default=None, help="--benchmark JSON path (default: RUN/benchmark.json)")
    train.add_argument("--nproc", type=int, metavar="N",
                       help="N data-parallel ranks on this node, one GPU each (execs torchrun --nproc-per-node N; "
                            "several nodes: run torchrun yourself, see docs/GPU.md § Several GPUs) "
                            "(default: one process)")
    train.set_defaults(func=cmd_train)


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """`epirl train ... --nproc N` on one node: torchrun running the same command without --nproc
    (`--standalone`: a free rendezvous port, so two jobs on one host do not collide)."""
    rest, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--nproc":
            skip = True
        elif not item.startswith("--nproc="):
            rest.append(item)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "epirl", *rest]


def cmd_train(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    verbose = verbose_requested(args)
    try:  # the recipe first: a bad key is one line before torchrun starts N ranks that would each print it
        recipe, cfg = _recipe_and_config(args)
        if args.help_config:
            print_config_reference(cfg if recipe is not None else None)
            return 0
        if args.print_config:
            sys.stdout.write(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
            return 0
    except InputError as exc:
        error_line(console, str(exc))
        return 2
    from epirl.rl.distributed import launched_world

    rank, world, _ = launched_world()
    if args.nproc is not None and (args.nproc < 1 or (world > 1 and args.nproc != world)):
        error_line(console, f"--nproc {args.nproc}: must be at least 1 and, inside a torchrun job, its rank count {world}")
        return 2
    if args.nproc not in (None, 1) and world == 1:
        command = torchrun_command(args.nproc, sys.argv[1:])
        os.execv(command[0], command)  # torchrun replaces this process: its exit status is the job's
    try:
        start_step, resume_note = _resume_step(args.resume)
        benchmark = _benchmark_settings(args, cfg)
    except InputError as exc:
        error_line(console, str(exc))
        return 2
    if resume_note is not None and rank == 0:  # one line per job, not per rank
        console.print(f"[yellow]warning:[/] {escape(resume_note)}", soft_wrap=True, highlight=False)
    run_dir = Path(args.resume) if args.resume else cfg.run_dir
    quiet_library_environment()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.dry_run:
        return _dry_run(cfg, run_dir, verbose, args.log_level, benchmark)
    # Rank 0 owns the run folder and the console; other ranks log to train.rank<r>.log and remove nothing.
    created = first_missing(run_dir) if rank == 0 else None
    with RunOutput(run_dir / ("train.log" if rank == 0 else f"train.rank{rank}.log"), verbose, args.log_level) as out:
        if resume_note is not None:  # shown on the terminal above; train.log keeps it too
            log.warning(resume_note, extra={"terminal": False})
        return _run(cfg, run_dir, start_step, out, created, resume=args.resume is not None, benchmark=benchmark,
                    rank=rank)


def _benchmark_settings(args, cfg) -> BenchmarkSettings | None:
    """`--benchmark N`: the real loop on synthetic prompts, in its own `<name>-benchmark` folder."""
    if args.benchmark is None:
        return None
    from epirl.rl.benchmark import BenchmarkSettings

    if args.benchmark < 1 or args.resume is not None:
        raise InputError("--benchmark N needs N >= 1 and no --resume")
    cfg.name = f"{cfg.name}-benchmark"  # never the folder of a real run
    return BenchmarkSettings(args.benchmark, args.prompt_tokens, args.force_max_tokens, args.benchmark_out)


# ------------------------------------------------------------------------------------------ inputs
def _recipe_and_config(args):
    """(recipe path or None, validated config). `--resume` without a recipe reuses the run's config.yaml."""
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not Path(recipe).is_file():  # `--resume RUN rl.steps=20`
        recipe, overrides = None, [recipe, *overrides]
    if args.resume is not None:
        run = Path(args.resume)
        if not run.is_dir():
            raise InputError(f"--resume {args.resume}: the run folder does not exist")
        if recipe is None:
            recipe = run / "config.yaml"
            if not recipe.is_file():
                raise InputError(f"--resume {args.resume}: not a run folder (no config.yaml in it)")
    if recipe is None:
        if args.help_config:
            return None, EpirlConfig()
        raise InputError("epirl train needs a recipe (or --resume RUN_DIR); see recipes/")
    try:
        return recipe, load_config(recipe, overrides)
    except ConfigError as exc:
        raise InputError(str(exc)) from None


def _resume_step(resume: str | None) -> tuple[int, str | None]:
    """(the step `--resume` continues after, a one-line warning naming damaged newer checkpoints or None).

    Every file of a checkpoint is checked before it is used; none whole is an InputError (one line)."""
    if resume is None:
        return 0, None
    from epirl.checkpoint import read_state, resumable_checkpoint

    checkpoint, damaged = resumable_checkpoint(Path(resume))
    found = ", ".join(f"{folder.name} ({reason})" for folder, reason in damaged)
    if checkpoint is None:
        detail = f"; damaged: {found}" if found else ""
        raise InputError(f"--resume {resume}: no complete checkpoint under {Path(resume) / 'checkpoints'}{detail}")
    step = int(read_state(checkpoint)["step"])
    if not damaged:
        return step, None
    verb = "is" if len(damaged) == 1 else "are"
    return step, f"--resume {resume}: checkpoint {found} {verb} damaged; continuing from {checkpoint.name} (step {step})"


def _check_and_plan(cfg, run_dir: Path, console: Console, benchmark=None, dry_run: bool = False) -> list | None:
    """Inputs checked (one-line errors as InputError), thread plan applied, the plan printed; the problems.

    Random weights (`model.load_format=dummy`) are set up and checked by `train` itself (it rewrites
    model.path first): then only the threads and the config's source are checked here, and None is returned.
    A dry run sets them up here instead, so that it checks and plans what the run would."""
    from epirl.model.dummy import prepare as prepare_random_weights
    from epirl.model.memory import PreflightError, preflight_beside_engine
    from epirl.plan import plan_lines
    from epirl.rl.loop import check_inputs

    threads = plan_threads()
    try:
        device = resolve_runtime(cfg)
        if device.type == "cpu":  # before vLLM starts: it keeps an OMP_NUM_THREADS it finds (cpu_threads)
            apply_thread_plan(threads)
        if cfg.model.load_format == "dummy":
            _check_random_weights_source(cfg)
            if not dry_run:
                return None
            prepare_random_weights(cfg)  # model.path becomes the config's folder, as `train` makes it
        problems = check_inputs(cfg, need_data=benchmark is None)
        if device.type == "cuda":
            preflight_beside_engine(cfg, device)
    except (ConfigError, DataError, PreflightError) as exc:
        raise InputError(str(exc)) from None
    thread_text = threads.describe() if device.type == "cpu" else None
    benchmark_steps = benchmark.steps if benchmark else None
    for label, text in plan_lines(cfg, device, len(problems), thread_text, run_dir, benchmark_steps):
        plan_line(console, label, text, log)
    warning = threads.warning(device.type == "cpu")
    if warning:
        log.warning(warning)  # once, at start; the terminal handler shows epirl warnings
    return problems


def _check_random_weights_source(cfg) -> None:
    """Random weights need only the architecture's config.json: a hub id without a config shipped under
    recipes/configs/ is fetched from the hub, so an unreachable hub is one line that names the shipped configs
    (one check, where the hub client would retry for a minute)."""
    from epirl.model.dummy import SHIPPED_CONFIGS, shipped_config_dir

    path = resolve_model_path(cfg.model.path)
    if hub.local_path(path) is not None or shipped_config_dir(path) is not None:
        return
    shipped = sorted(folder.name for folder in SHIPPED_CONFIGS.iterdir()) if SHIPPED_CONFIGS.is_dir() else []
    folder = _shown_path(SHIPPED_CONFIGS)
    example = f"model.path={folder}/{shipped[-1]}" if shipped else "model.path=FOLDER_WITH_CONFIG_JSON"
    hub.require_hub("model.path", cfg.model.path, InputError,
                    hint=f"random weights need only a config.json: use one shipped in {folder}/ "
                         f"({', '.join(shipped)}), e.g. {example}")


def _shown_path(path: Path) -> str:
    """`path` relative to the working folder when it lies inside it (`recipes/configs`), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _dry_run(cfg, run_dir: Path, verbose: bool, level: str, benchmark: BenchmarkSettings | None = None) -> int:
    """Everything `train` checks before the engine starts, and the plan; writes nothing."""
    with tempfile.TemporaryDirectory(prefix="epirl-dry-run-") as tmp, \
            RunOutput(Path(tmp) / "train.log", verbose, level) as out:
        try:
            _check_and_plan(cfg, run_dir, out.console, benchmark, dry_run=True)
            _check_engine_config(cfg)
        except InputError as exc:
            error_line(out.console, str(exc))
            return 2
        out.console.print("[green]dry run:[/] data, model, engine arguments and memory plan are valid; "
                          "nothing was trained or written", soft_wrap=True, highlight=False)
    return 0


def _check_engine_config(cfg) -> None:
    """vLLM's own validation of the engine arguments (EngineArgs → VllmConfig), without loading weights."""
    from epirl.engine import plugin
    from epirl.engine.engine import llm_kwargs, quantization_method
    from epirl.engine.vllm_compat import engine_args

    library_records: list[logging.LogRecord] = []
    try:
        engine_args.set_process_env(cfg.engine.cpu_kv_cache_gb)  # read by vLLM when it is imported (next)
        plugin.register()  # epirl's quantization methods, which the arguments may name
        kwargs = llm_kwargs(cfg, resolve_model_path(cfg.model.path), quantization_method(cfg.engine.precision))
        with library_records_held() as library_records:  # vLLM's error records: train.log only, read below
            engine_args.validate_engine_config(kwargs)  # imports vLLM: only here, once output goes to train.log
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - vLLM's refusal, in its own words, on one line
        missing = missing_model_package(exc, library_records)
        if missing is not None:
            architecture, package = missing
            raise InputError(f"engine: vLLM's implementation of {architecture or cfg.model.path} needs the package "
                             f"{package}, which this install lacks") from None
        reason = first_line(exc)
        raise InputError(f"engine: vLLM refuses the engine arguments: {type(exc).__name__}: {reason}") from None


_MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")
_INSPECTED_ARCHITECTURE = re.compile(r"model architecture '(\w+)'")


def missing_model_package(exc: BaseException, records: list[logging.LogRecord]) -> tuple[str | None, str] | None:
    """(architecture, top-level package) when vLLM could not import a model's implementation, else None.

    vLLM inspects a model class in a subprocess: the ModuleNotFoundError reaches us only as text, in the error
    it raises and in the error it logged (`Error in inspecting model architecture 'X'` + the subprocess's
    traceback). Warnings are not read: some installs warn of optional modules they lack at import."""
    texts = [str(exc), *(str(link) for link in _exception_chain(exc))]
    for record in records:
        if record.levelno < logging.ERROR:
            continue
        texts.append(record.getMessage())
        if record.exc_info:
            texts.append("".join(traceback.format_exception(*record.exc_info)))
    text = "\n".join(texts)
    module = _MISSING_MODULE.search(text)
    if module is None:
        return None
    architecture = _INSPECTED_ARCHITECTURE.search(text)
    return (architecture.group(1) if architecture else None), module.group(1).split(".")[0]


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


# ------------------------------------------------------------------------------------------ the run
def _run(cfg, run_dir: Path, start_step: int, out: RunOutput, created: Path | None, resume: bool,
         benchmark: BenchmarkSettings | None = None, rank: int = 0) -> int:
    from epirl.progress import RunProgress
    from epirl.rl.benchmark import format_table
    from epirl.rl.loop import train

    console = out.console
    total = benchmark.steps if benchmark else cfg.rl.steps
    observer = RunProgress(console, run_dir, total, start_step, cfg.rl.samples_per_prompt)
    try:
        problems = _check_and_plan(cfg, run_dir, console, benchmark)
        out_dir = train(cfg, resume=run_dir if resume else None, progress=observer, benchmark=benchmark,
                        problems=problems)
    except KeyboardInterrupt:
        observer.stop()
        log.warning("interrupted", extra={"terminal": False})
        kept = _keep_failed(run_dir, created, observer)
        console.print(f"[yellow]interrupted[/]: {escape(interrupted_state(run_dir, kept, benchmark is not None))}",
                      soft_wrap=True, highlight=False)
        return 130
    except Exception as exc:  # noqa: BLE001 - reported below: one line, or the end of train.log
        observer.stop()
        if isinstance(exc, bad_input_errors()) and not observer.session_rows:
            return _bad_input(out, exc, run_dir, created)
        log.exception("training failed", extra={"terminal": False})
        out.restore()
        kept = _keep_failed(run_dir, created, observer)
        show_failure(console, exc, kept / "train.log")
        return 1
    if rank != 0:
        return 0
    observer.print_summary(out_dir)
    if benchmark is not None:  # the table is the benchmark's result: on the console, not only in train.log
        result = Path(benchmark.out) if benchmark.out else out_dir / "benchmark.json"
        console.print(format_table(json.loads(result.read_text())), markup=False, highlight=False, soft_wrap=True)
        console.print(f"[green]benchmark:[/] {result} (rewards were a seeded coin)", soft_wrap=True, highlight=False)
    return 0


def bad_input_errors() -> tuple[type[Exception], ...]:
    """The errors that are bad input (one line, exit 2) when raised before step 1."""
    from epirl.model.memory import PreflightError

    return ConfigError, DataError, PreflightError, InputError


def _bad_input(out: RunOutput, exc: Exception, run_dir: Path, created: Path | None) -> int:
    """One line, exit 2, and no run folder left behind by this command."""
    log.error("%s", exc, extra={"terminal": False})
    out.restore()
    if created is not None:
        remove_created(run_dir, created)
    error_line(out.console, str(exc))
    return 2


def interrupted_state(run_dir: Path, kept: Path, benchmark: bool) -> str:
    """What an interrupted run left on disk, and what to do with it: only a whole checkpoint can be resumed."""
    if kept != run_dir:
        return f"before step 1; nothing to resume; log in {kept / 'train.log'}"
    if benchmark:
        return f"a benchmark writes no checkpoints; log in {run_dir / 'train.log'}"
    from epirl.checkpoint import latest_checkpoint, read_state

    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return (f"no complete checkpoint under {run_dir / 'checkpoints'}, so there is nothing to resume; "
                f"log in {run_dir / 'train.log'}")
    return (f"the last complete checkpoint is {checkpoint.name} (step {read_state(checkpoint)['step']}); "
            f"continue with --resume {run_dir}")


def _keep_failed(run_dir: Path, created: Path | None, observer) -> Path:
    """A run this command created that failed before its first step: moved to `<name>.failed` (log kept)."""
    if created is None or observer.session_rows or not run_dir.exists():
        return run_dir
    return move_to_failed(run_dir)


# ------------------------------------------------------------------------------------------ --help-config
def print_config_reference(cfg=None) -> None:
    """Every key with its default and meaning; with a recipe, its value there too (bold where it differs)."""
    title = "epirl config keys (recipe YAML or key.sub=value)"
    table = Table(title=title, show_lines=False)
    columns = ("key", "value", "default", "meaning") if cfg is not None else ("key", "default", "meaning")
    for column in columns:
        table.add_column(column, overflow="fold")
    for key, default, doc in describe_fields():
        if cfg is None:
            table.add_row(key, default, doc)
            continue
        value = repr(functools.reduce(getattr, key.split("."), cfg))
        table.add_row(key, f"[bold]{escape(value)}[/]" if value != default else escape(value), default, doc)
    Console().print(table)
