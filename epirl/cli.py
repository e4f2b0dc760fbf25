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
import importlib
import sys

from rich.console import Console

from epirl.console import error_line

console = Console(stderr=True)

# subcommand -> (module, the function that adds its parser). Only the module of the command asked for is imported
# (each pulls in torch, vLLM or scipy: seconds); `epirl --help` and a mistyped command import them all.
SUBCOMMANDS = {
    "train": ("epirl.train_cli", "add_train_args"),
    "mismatch": ("epirl.mismatch.cli", "add_mismatch_args"),
    "eval": ("epirl.eval_cli", "add_eval_args"),
    "compare": ("epirl.compare_cli", "add_compare_args"),
    "kernels": ("epirl.kernels_cli", "add_kernels_args"),
}


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage mistake (unknown option, `--max-tokens abc`, a missing value) is one line and exit code 2, like
    every other bad input; the usage it would print is what `--help` shows. Subcommand parsers inherit it."""

    def error(self, message: str):
        error_line(console, f"{self.prog}: {message} (see {self.prog} --help)")
        raise SystemExit(2)


def build_parser(commands=tuple(SUBCOMMANDS)) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="epirl", description="RL post-training of LoRA adapters on one FP8 base.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="library logs on the terminal too (the same as a command's --verbose)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in commands:
        module, add_args = SUBCOMMANDS[name]
        getattr(importlib.import_module(module), add_args)(sub)
    parser.set_defaults(command_parsers=sub.choices)  # a subcommand's own usage errors name it
    return parser


def _asked_command(argv: list[str]) -> tuple[str, ...]:
    """The subcommand named on the command line (after global options), else every one."""
    first = next((item for item in argv if not item.startswith("-")), None)
    return (first,) if first in SUBCOMMANDS else tuple(SUBCOMMANDS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_asked_command(argv))
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
