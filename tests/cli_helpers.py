"""`epirl ...` run inside the test process (seconds, where a subprocess pays ~6 s of imports per call)."""

from __future__ import annotations

import logging
import os

from epirl.cli import main

# Environment defaults the commands set for the libraries they start (epirl.console.quiet_library_environment).
COMMAND_ENVIRONMENT = ("VLLM_CONFIGURE_LOGGING", "TOKENIZERS_PARALLELISM", "WANDB_SILENT", "TRANSFORMERS_VERBOSITY",
                       "VLLM_ENABLE_V1_MULTIPROCESSING")


def run_cli(argv: list[str], capfd) -> tuple[int, list[str]]:
    """(exit code, the non-empty lines the command wrote to stdout and stderr). What the command changes in
    the process (environment defaults, root logging handlers) is put back afterwards."""
    environment = {name: os.environ.get(name) for name in COMMAND_ENVIRONMENT}
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    capfd.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: --help, usage errors
        code = exc.code
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    captured = capfd.readouterr()
    return code, [line for line in (captured.out + captured.err).splitlines() if line.strip()]
