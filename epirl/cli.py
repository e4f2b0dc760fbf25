"""`epirl` command line: `train`, `mismatch`, `eval`, `compare`, `kernels`.

    epirl train recipes/smollm2_arith_cpu.yaml rl.steps=20 engine.precision=w8a16
    epirl train recipes/qwen35_9b_dapo.yaml --resume runs/qwen35_9b_dapo
    epirl train --help-config            # every config key with its default and meaning

`train` lives in epirl.train_cli, `eval` in epirl.eval_cli, `mismatch` in epirl.mismatch.cli, `compare` in
epirl.compare_cli, `kernels explain` (which kernel runs per projection) in epirl.kernels_cli; each has the quiet
console of epirl.console (plan, progress, results on the terminal; what libraries print in the command's log file).
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from epirl.compare_cli import add_compare_args
from epirl.console import error_line
from epirl.eval_cli import add_eval_args
from epirl.kernels_cli import add_kernels_args
from epirl.mismatch.cli import add_mismatch_args
from epirl.train_cli import add_train_args

console = Console(stderr=True)


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage mistake (unknown option, `--max-tokens abc`, a missing value) is one line and exit code 2, like
    every other bad input; the usage it would print is what `--help` shows. Subcommand parsers inherit it."""

    def error(self, message: str):
        error_line(console, f"{self.prog}: {message} (see {self.prog} --help)")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="epirl", description="RL post-training of LoRA adapters on one FP8 base.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="library logs on the terminal too (the same as a command's --verbose)")
    sub = parser.add_subparsers(dest="command", required=True)

    add_train_args(sub)
    add_mismatch_args(sub)
    add_eval_args(sub)
    add_compare_args(sub)
    add_kernels_args(sub)
    parser.set_defaults(command_parsers=sub.choices)  # a subcommand's own usage errors name it
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # `train RECIPE --dry-run rl.steps=2`: overrides after an option are still overrides
        if args.command == "train" and all("=" in item and not item.startswith("-") for item in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            args.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except KeyboardInterrupt:  # a training run reports its own folder; elsewhere results are written at the end
        console.print("[yellow]interrupted[/]: no results were written", soft_wrap=True, highlight=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())
