"""`epirl` command line: `train`, `mismatch`, `eval`.

    epirl train recipes/smollm2_arith_cpu.yaml rl.steps=20 engine.precision=w8a16
    epirl train recipes/qwen35_9b_dapo.yaml --resume runs/qwen35_9b_dapo
    epirl train --help-config            # every config key with its default and meaning
    epirl train recipes/smollm2_arith_cpu.yaml --nproc 2      # = torchrun --nproc-per-node 2 -m epirl train ...
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from epirl.checkpoint import latest_checkpoint
from epirl.config import ConfigError, describe_fields, load_config
from epirl.data import DataError
from epirl.eval_cli import add_eval_args
from epirl.mismatch.cli import add_mismatch_args
from epirl.model.memory import PreflightError
from epirl.rl.distributed import launched_world
from epirl.rl.benchmark import BenchmarkSettings
from epirl.rl.loop import train

console = Console(stderr=True)


def error_line(message: str) -> None:
    """One line, however long: rich would hard-wrap at 80 columns when stderr is not a terminal."""
    console.print(f"[red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)  # "[...]" is not markup


def setup_logging(verbose: bool, log_file: Path | None = None) -> None:
    handlers: list[logging.Handler] = [RichHandler(console=console, show_path=False, rich_tracebacks=False)]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(file_handler)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=handlers, force=True,
                        format="%(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _print_config_reference() -> None:
    table = Table(title="epirl config keys (recipe YAML or key.sub=value)", show_lines=False)
    for column in ("key", "default", "meaning"):
        table.add_column(column, overflow="fold")
    for key, default, doc in describe_fields():
        table.add_row(key, default, doc)
    Console().print(table)


def _progress_printer(total: int, start: int):
    progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), TextColumn("{task.description}"), console=console)
    task = progress.add_task("", total=total, completed=start)

    def update(step: int, metrics: dict) -> None:
        summary = (f"acc {metrics.get('reward/accuracy', 0):.3f} reward {metrics.get('reward/mean', 0):+.3f} "
                   f"len {metrics.get('response/length_mean', 0):.0f} kl {metrics.get('mismatch/k3_kl', 0):.2e} "
                   f"{metrics.get('time/step_s', 0):.1f}s")
        progress.update(task, completed=step, description=summary)
        progress.console.log(f"step {step}: {summary}")

    return progress, update


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
    if args.help_config:
        _print_config_reference()
        return 0
    rank, world, _ = launched_world()
    if args.nproc is not None and args.nproc < 1:
        error_line(f"--nproc {args.nproc}: must be at least 1")
        return 2
    if args.nproc not in (None, 1) and world == 1:
        command = torchrun_command(args.nproc, args.argv)
        os.execv(command[0], command)  # torchrun replaces this process: its exit status is the job's
    if args.nproc not in (None, world):
        error_line(f"--nproc {args.nproc} inside a torchrun job of {world} rank(s): give one or the other")
        return 2
    if args.recipe is None and args.resume is None:
        console.print("[red]error:[/] epirl train needs a recipe (or --resume RUN_DIR)")
        return 2
    recipe = args.recipe
    if recipe is None:  # resume without a recipe: the run's own resolved config
        recipe = Path(args.resume) / "config.yaml"
    try:
        cfg = load_config(recipe, args.overrides)
    except ConfigError as exc:
        error_line(str(exc))
        return 2
    if args.resume is not None and not Path(args.resume).is_dir():
        error_line(f"--resume {args.resume}: no such run folder")
        return 2
    if args.resume is not None:
        if latest_checkpoint(Path(args.resume)) is None:
            error_line(f"--resume {args.resume}: no complete checkpoint under {Path(args.resume) / 'checkpoints'}")
            return 2
    benchmark = None
    if args.benchmark is not None:
        if args.benchmark < 1 or args.resume is not None:
            error_line("--benchmark N needs N >= 1 and no --resume")
            return 2
        benchmark = BenchmarkSettings(args.benchmark, args.prompt_tokens, args.force_max_tokens, args.benchmark_out)
        cfg.name = f"{cfg.name}-benchmark"  # never the folder of a real run
    run_dir = Path(args.resume) if args.resume else cfg.run_dir
    setup_logging(args.verbose, run_dir / ("train.log" if rank == 0 else f"train.rank{rank}.log"))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    # One progress bar and one summary: rank 0's (every rank logs to its own train[.rank<r>].log).
    total = benchmark.steps if benchmark else cfg.rl.steps
    progress, update = _progress_printer(total, 0) if rank == 0 else (contextlib.nullcontext(), None)
    try:
        with progress:
            out = train(cfg, resume=Path(args.resume) if args.resume else None, progress=update, benchmark=benchmark)
    except (ConfigError, DataError, PreflightError) as exc:  # found once the inputs are read: one line
        logging.getLogger("epirl").error("%s", exc)  # and in train.log
        if rank == 0:  # every rank read the same inputs
            error_line(str(exc))
        return 2
    if rank != 0:
        return 0
    if benchmark is not None:
        console.print(f"[green]done:[/] benchmark in {benchmark.out or out / 'benchmark.json'} (rewards were a seeded coin)")
        return 0
    console.print(f"[green]done:[/] {out} (adapter in {out / 'adapter'}, metrics in {out / 'metrics.jsonl'})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epirl", description="RL post-training of LoRA adapters on one FP8 base.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="colocated GRPO/DAPO training")
    train.add_argument("recipe", nargs="?", help="YAML recipe (see recipes/)")
    train.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. rl.steps=5")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    train.add_argument("--help-config", action="store_true", help="print every config key and exit")
    train.add_argument("--nproc", type=int, metavar="N",
                       help="N data-parallel ranks on this node, one GPU each (execs torchrun --nproc-per-node N; "
                            "several nodes: run torchrun yourself, see README)")
    train.add_argument("--benchmark", type=int, metavar="N", help="measure the real loop for N steps on synthetic "
                       "token-id prompts with seeded-coin rewards (no data, no checkpoints); writes benchmark.json")
    train.add_argument("--prompt-tokens", type=int, default=None, help="--benchmark prompt length (default 256)")
    train.add_argument("--force-max-tokens", action="store_true", help="--benchmark: every response runs to rl.max_tokens")
    train.add_argument("--benchmark-out", default=None, help="--benchmark JSON path (default RUN/benchmark.json)")
    train.set_defaults(func=cmd_train)

    add_mismatch_args(sub)
    add_eval_args(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command != "train":
        setup_logging(args.verbose)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: completed checkpoints are intact; continue with --resume")
        return 130


if __name__ == "__main__":
    sys.exit(main())
