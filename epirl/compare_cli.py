"""`epirl compare`: the precision study as one command. The recipe is trained once per (pairing, seed), each
run in its own process and its own run folder; each finished adapter is scored on a held-out test set; one
table compares the pairings.

    epirl compare recipes/smollm2_arith_cpu.yaml --pairings bf16,w8a16,w8a8,w8a8-notis --seeds 3 --steps 40
    epirl compare recipes/smollm2_arith_cpu.yaml --pairings bf16,mine --pairings-file pairings.yaml rl.max_tokens=24

Built-in pairings (engine precision · trainer base · correction):
  bf16        bf16 · bf16 · tis
  w8a16       w8a16 (the matched engine) · fp8 · none
  w8a8        w8a8 · shared (the engine's own FP8 weights) · tis    (the main recipe's default)
  w8a8-notis  w8a8 · shared · none                                   (what TIS buys)
  w8a16-bitwise  w8a16 + engine.bitwise · fp8 · none, bf16 model    (KL exactly 0; not in the default set)
More pairings come from --pairings-file, a YAML mapping of names to overrides (the recipe cannot hold them:
its schema refuses unknown keys):
  fp8-mis: [engine.precision=w8a8, trainer.base=fp8, rl.correction=mis]
  w8a16-shared: {engine: {precision: w8a16}, trainer: {base: shared}, rl: {correction: none}}

Runs: <output_dir>/compare_<name>/runs/<name>_<pairing>_s<seed>, each a normal `epirl train RECIPE name=...
seed=... output_dir=... <pairing overrides> <your overrides>` run. Repeating the command continues the study: a
finished run is not trained again, a run stopped by the probe is kept as a result (remove its folder to retry),
an unfinished run resumes from its last complete checkpoint, one without a checkpoint is moved to <run>.old and
started afresh. A run folder made with other settings is refused.

Held-out test (recipes with data.source: arithmetic): --heldout-size problems drawn from the task's distribution
in a seed namespace of their own; every run trains on its recipe's seeded problem list without them (a file
under compare_<name>/data/), so no run ever sees a test problem. Each finished adapter answers each problem once,
greedily. Other recipes get no held-out evaluation. Outputs, rewritten after every finished run: summary.md (one
row per pairing: held-out accuracy with its 95 % bootstrap interval over problems and per seed, the difference to
bf16 paired on the problems and over seeds (Welch's t-interval: the wider one, training randomness), final reward,
KL(engine‖trainer), bitwise-equal log-probs, TIS clip fraction, probe β, seconds per step by phase, peak memory),
summary.json and curves.png (reward and KL against step, mean ± 1 s.d. over seeds).

Console: the plan, a progress bar over the pending runs with a line per finished run, and the table (on
standard output). Each run's output is in compare_<name>/logs/; what libraries print in the command itself goes
to compare_<name>/compare.log (--verbose: to the terminal too). Bad input (unknown pairing, bad --seeds,
missing recipe, bad override) is one line and exit code 2, with nothing written; a failed run or evaluation
gives exit code 1 (repeat the command to continue); a crash of the command itself prints the end of
compare.log, and a study folder it created is moved to compare_<name>.failed. SIGTERM (e.g. `timeout`) ends
the running processes too; the next command resumes them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import sys
import threading
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from epirl.compare.spec import DEFAULT_PAIRINGS, EVAL_ENGINES, CompareInputError, CompareSpec, check_user_overrides
from epirl.compare.spec import parse_seeds, select_pairings
from epirl.console import (DefaultsHelpFormatter, RunOutput, add_verbose_arg, error_line, quiet_library_environment,
                           run_in_folder, verbose_requested)

log = logging.getLogger("epirl.compare")


def _with_trailing_overrides(parser: argparse.ArgumentParser) -> None:
    """`epirl compare RECIPE --seeds 3 rl.steps=40`: argparse leaves `key=value` items after an option unparsed,
    and `epirl`'s main only folds such leftovers into `train`'s overrides; the compare parser folds its own."""
    parse_known_args = parser.parse_known_args

    def parse_known_args_with_overrides(args=None, namespace=None):
        namespace, extra = parse_known_args(args, namespace)
        trailing = [item for item in extra if "=" in item and not item.startswith("-")]
        namespace.overrides = [*getattr(namespace, "overrides", []), *trailing]
        return namespace, [item for item in extra if item not in trailing]

    parser.parse_known_args = parse_known_args_with_overrides  # type: ignore[method-assign]


def add_compare_args(subparsers) -> argparse.ArgumentParser:
    """Register the ``compare`` subcommand on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser("compare", help="train a recipe under several engine/trainer pairings and seeds, "
                                   "evaluate held-out, one table", description=__doc__,
                                   formatter_class=DefaultsHelpFormatter)
    parser.add_argument("recipe", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides for every run, applied after the pairing's (e.g. rl.max_tokens=24)")
    parser.add_argument("--pairings", default=",".join(DEFAULT_PAIRINGS),
                        help="comma-separated pairing names: built-ins (above) or names from --pairings-file")
    parser.add_argument("--pairings-file", metavar="FILE", default=None,
                        help="YAML mapping: pairing name -> list of key=value overrides or nested mapping (above) "
                             "(default: none)")
    parser.add_argument("--seeds", default="3", help="a count (3 = seeds 0, 1, 2) or a comma list (0,5,7)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="runs side by side, one GPU each (worker k uses the k-th visible GPU); 1 = one after "
                             "another")
    parser.add_argument("--runs-per-gpu", type=int, default=1,
                        help="runs side by side on each GPU (a small model leaves most of a GPU idle); their "
                             "engine.gpu_memory_utilization shares must add up to <= 0.9, and each needs "
                             "engine.vllm_args.kv_cache_memory_bytes")
    parser.add_argument("--steps", type=int, default=None, help="rl.steps of every run (default: the recipe's)")
    parser.add_argument("--heldout-size", type=int, default=500, help="held-out problems (arithmetic recipes)")
    parser.add_argument("--eval-engine", default="run", choices=EVAL_ENGINES,
                        help="engine precision of the held-out evaluation; run = the precision each run trained with")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples per interval")
    parser.add_argument("--dry-run", action="store_true", help="check every input, print the plan, run nothing")
    add_verbose_arg(parser, "compare_<name>/compare.log")
    parser.set_defaults(func=run_compare_command)
    _with_trailing_overrides(parser)
    return parser


def build_spec(args: argparse.Namespace) -> CompareSpec:
    """The study from the parsed command line; raises CompareInputError (one line)."""
    for flag, value, minimum in (("--nproc", args.nproc, 1), ("--runs-per-gpu", args.runs_per_gpu, 1),
                                 ("--steps", args.steps, 1),
                                 ("--heldout-size", args.heldout_size, 1), ("--resamples", args.resamples, 100)):
        if value is not None and value < minimum:
            raise CompareInputError(f"{flag} must be >= {minimum}, got {value}")
    pairings = select_pairings(args.pairings, args.pairings_file)
    seeds = parse_seeds(args.seeds)
    overrides = list(args.overrides)
    check_user_overrides(overrides, pairings)
    if args.steps is not None:
        overrides.append(f"rl.steps={args.steps}")
    return CompareSpec(recipe=Path(args.recipe), pairings=pairings, seeds=seeds, overrides=tuple(overrides),
                       nproc=args.nproc, runs_per_gpu=args.runs_per_gpu, heldout_size=args.heldout_size,
                       eval_engine=args.eval_engine, resamples=args.resamples, dry_run=args.dry_run,
                       command_line=shlex.join(["epirl", "compare", *_typed_arguments(args)]))


def _typed_arguments(args: argparse.Namespace) -> list[str]:
    """The arguments after `compare` as typed (recorded with the results)."""
    if hasattr(args, "argv"):
        return list(args.argv)
    return sys.argv[sys.argv.index("compare") + 1:] if "compare" in sys.argv else sys.argv[1:]


class StudyProgress:
    """A launcher (epirl.compare.execute) around another: a bar over the study's pending runs, with the processes
    running now beside it. Shown only on a terminal; the study prints a line per finished run anyway."""

    def __init__(self, launcher, pending: int, console: Console):
        self.launcher, self.live = launcher, []
        self._lock = threading.Lock()  # launches come from the study's worker threads
        self.bar = Progress(TextColumn("[bold]runs"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                            TextColumn("{task.description}"), console=console, transient=True,
                            redirect_stdout=False, redirect_stderr=False, disable=not console.is_terminal)
        self.task = self.bar.add_task("", total=pending)

    def __call__(self, launch) -> int:
        label = f"{launch.kind} {launch.run.label}"
        self._running(label, started=True)
        try:
            code = self.launcher(launch)
        finally:
            self._running(label, started=False)
        return code

    def _running(self, label: str, started: bool) -> None:
        with self._lock:
            if started:
                self.live.append(label)
            else:
                self.live.remove(label)
            self.bar.update(self.task, description=", ".join(self.live))

    def run_done(self, outcome) -> None:
        """One run of the study trained and evaluated (or given up): the bar one further."""
        self.bar.advance(self.task)

    def terminate(self) -> None:  # SIGTERM: the study ends the running processes through its launcher
        terminate = getattr(self.launcher, "terminate", None)
        if terminate is not None:
            terminate()


def run_compare_command(args: argparse.Namespace, launcher=None) -> int:
    """Entry point of ``epirl compare``; returns the process exit code. `launcher`: how runs are started
    (default: a process each, epirl.compare.execute.ProcessLauncher)."""
    # deferred: these load transformers and math_verify, which `epirl compare --help` need not
    from epirl.compare.execute import ProcessLauncher, check_gpu_sharing, gpu_ids, needs_work
    from epirl.compare.plan import plan_study
    from epirl.compare.study import run_study

    verbose = verbose_requested(args)
    quiet_library_environment()
    with RunOutput(None, verbose) as checking:  # the study's own checks run again inside run_study; here they
        try:                                    # come first so that bad input leaves no folder and no log
            spec = build_spec(args)
            plan = plan_study(spec)
            pending = sum(needs_work(plan, run) for run in plan.runs)
            if pending:
                gpu_ids(spec.nproc)  # fewer GPUs than --nproc: refused before anything is written
                check_gpu_sharing(plan, spec.runs_per_gpu)
        except (CompareInputError, ValueError) as exc:
            error_line(checking.console, str(exc))
            return 2
        if spec.dry_run:
            return run_study(spec, checking.console)

    def study(out: RunOutput) -> int:
        progress = StudyProgress(launcher or ProcessLauncher(), pending, out.console)
        with progress.bar, contextlib.redirect_stdout(out.stdout):  # the table: standard output, not the log
            return run_study(spec, out.console, progress, on_run_done=progress.run_done)

    return run_in_folder(plan.study_dir, "compare.log", verbose, log, study)
