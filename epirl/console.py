"""What `epirl train` shows on the terminal, and where everything else goes.

Quiet by default: file descriptors 1 and 2 are pointed at `runs/<name>/train.log` for the whole run, so
everything that libraries print — vLLM's and Triton's loggers, C++ warnings (NUMA binding), tqdm bars, W&B's
banners, Python warnings — lands in the log, not on the terminal. The terminal is reached only through
`RunOutput.console`, a rich Console on a saved copy of the original stderr. `--verbose` skips the
redirection and shows every log record on the terminal as well.

Logging: the root logger writes every record at the chosen level to train.log; the terminal handler passes
only epirl's own warnings and errors (and any library's errors) in quiet mode. vLLM is told not to install
its own stdout handler (`VLLM_CONFIGURE_LOGGING=0`) so its records reach train.log through the root logger.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_LIBRARY_LOGGERS = ("httpx", "urllib3", "filelock", "datasets", "matplotlib", "PIL", "asyncio")


def error_line(console: Console, message: str) -> None:
    """One line, however long: rich would hard-wrap at 80 columns when stderr is not a terminal."""
    console.print(f"[red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)  # "[...]" is not markup


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help` with every option's default: appended as "(default: ...)" unless the help text already says
    it (an option whose default is computed names it in words). The description keeps its line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or "%(default" in text or action.default is argparse.SUPPRESS or action.required:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text  # a required positional has no default
        return f"{text} (default: %(default)s)".lstrip()


def log_tail(path: Path, lines: int = 25) -> list[str]:
    """The last lines of a log, without the carriage-return redraws of progress bars."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    kept = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    return [line for line in kept if line.strip()][-lines:]


class _TerminalHandler(logging.Handler):
    """Records as single terminal lines (`warning: ...`), however long: the console soft-wraps, never splits."""

    STYLES = {"WARNING": "yellow", "ERROR": "red", "CRITICAL": "red"}

    def __init__(self, console: Console):
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = escape(self.format(record))
            style = self.STYLES.get(record.levelname)
            label = f"[{style}]{record.levelname.lower()}:[/] " if style else ""
            self.console.print(f"{label}{message}", soft_wrap=True, highlight=False)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


class _TerminalFilter(logging.Filter):
    """Quiet mode: epirl's own warnings and errors, and errors of anything else; never records marked
    `extra={"terminal": False}` (the CLI prints those itself, once)."""

    def __init__(self, quiet: bool):
        super().__init__()
        self.quiet = quiet

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "terminal", True):
            return False
        if not self.quiet:
            return True
        own = record.name == "epirl" or record.name.startswith("epirl.")
        return record.levelno >= (logging.WARNING if own else logging.ERROR)


def quiet_library_environment() -> None:
    """Environment that libraries read when they are imported or an engine starts: set before either."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's records go through our root logger
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the fork warning of HF tokenizers
    os.environ.setdefault("WANDB_SILENT", "true")  # banners; W&B warnings and errors still reach train.log
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")


class RunOutput:
    """Terminal + train.log for one command. Use as a context manager; `console` is the terminal.

    Without a log file (e.g. `--print-config`) nothing is redirected and records go to the terminal only."""

    def __init__(self, log_file: Path | None, verbose: bool = False, level: str = "INFO"):
        self.log_file, self.verbose, self.level = log_file, verbose, level.upper()
        self._saved: tuple[int, int] | None = None
        self._terminal = None
        self.console = Console(stderr=True)

    def __enter__(self) -> "RunOutput":
        if self.log_file is not None and not self.verbose:
            self._redirect()
        self._setup_logging()
        return self

    def _redirect(self) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        self._terminal = os.fdopen(os.dup(self._saved[1]), "w", buffering=1)
        self.console = Console(file=self._terminal)
        log_fd = os.open(self.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)

    def _setup_logging(self) -> None:
        terminal: logging.Handler = (RichHandler(console=self.console, show_path=False, rich_tracebacks=False)
                                     if self.verbose else _TerminalHandler(self.console))
        terminal.addFilter(_TerminalFilter(quiet=not self.verbose))
        handlers: list[logging.Handler] = [terminal]
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            file_handler = logging.FileHandler(self.log_file)
            file_handler.setFormatter(logging.Formatter(LOG_FORMAT))
            handlers.append(file_handler)
        logging.basicConfig(level=self.level, handlers=handlers, force=True, format="%(message)s")
        logging.captureWarnings(True)  # Python warnings (FutureWarning, ...) become records: train.log only
        for name in QUIET_LIBRARY_LOGGERS:
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
        if self._saved is not None:  # libraries that attached their own stream handler before we started
            for name in ("vllm", "transformers", "wandb"):
                logger = logging.getLogger(name)
                for handler in list(logger.handlers):
                    if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                        logger.removeHandler(handler)
                logger.propagate = True

    def restore(self) -> None:
        """Point fd 1 and 2 back at the terminal (idempotent). Later records still go to train.log."""
        if self._saved is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self._saved = None

    def __exit__(self, *exc) -> None:
        self.restore()
        logging.captureWarnings(False)
        for handler in logging.getLogger().handlers:
            handler.flush()
