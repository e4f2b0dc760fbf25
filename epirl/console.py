"""What every command (`epirl train`, `eval`, `mismatch`, `compare`) shows on the terminal, and where everything
else goes.

Quiet by default: file descriptors 1 and 2 are pointed at the command's log (`runs/<name>/train.log`,
`OUT/eval.log`, `OUT/mismatch.log`, `compare_<name>/compare.log`) for the whole command, so everything that
libraries print — vLLM's and Triton's loggers, C++ warnings (NUMA binding), tqdm bars, W&B's banners, Python
warnings — lands in the log, not on the terminal. The terminal is reached only through `RunOutput.console`, a
rich Console on a saved copy of the original stderr (and `RunOutput.stdout` for results others may pipe).
`--verbose` skips the redirection and shows every log record on the terminal as well. A crash moves an output
folder the command created to `<folder>.failed` and prints the end of its log (`run_in_folder`).

Logging: the root logger writes every record at the chosen level to train.log; the terminal handler passes
only epirl's own warnings and errors (and any library's errors) in quiet mode. vLLM is told not to install
its own stdout handler (`VLLM_CONFIGURE_LOGGING=0`) so its records reach train.log through the root logger.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LIBRARY_NAMES = "vLLM, Triton, W&B, transformers"
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


def add_verbose_arg(parser: argparse.ArgumentParser, log_name: str) -> None:
    """`--verbose`, the same on every command (its own dest: the top-level `epirl -v` must not be reset)."""
    parser.add_argument("--verbose", dest="command_verbose", action="store_true",
                        help=f"show library logs ({LIBRARY_NAMES}) on the terminal too; they always go to {log_name}")


def verbose_requested(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "verbose", False) or getattr(args, "command_verbose", False))


def plan_line(console: Console, label: str, text: str, logger: logging.Logger) -> None:
    """One row of a command's plan (`model    smollm2 ...`): bold label on the terminal, the same line in the log."""
    logger.info("%-8s %s", label, text, extra={"terminal": False})
    console.print(f"[bold]{label:<8}[/] {escape(text)}", soft_wrap=True, highlight=False)


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


class _LibraryRecordsToLog(logging.Filter):
    """Keeps every record of a library off the terminal (the log file still gets it) and collects it."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == "epirl" or record.name.startswith("epirl.")
        if not own and getattr(record, "terminal", True):  # the first handler to see it (each one calls this)
            record.terminal = False
            self.records.append(record)
        return True


@contextlib.contextmanager
def library_records_held():
    """While inside, what libraries log goes to the log file only, and is collected (the list yielded): for a
    call whose failure epirl explains in one line of its own (vLLM logs a subprocess's whole traceback)."""
    holder = _LibraryRecordsToLog()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.filters.insert(0, holder)  # before the terminal filter, which reads `record.terminal`
    try:
        yield holder.records
    finally:
        for handler in handlers:
            handler.removeFilter(holder)


def quiet_library_environment() -> None:
    """Environment that libraries read when they are imported or an engine starts: set before either."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's records go through our root logger
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the fork warning of HF tokenizers
    os.environ.setdefault("WANDB_SILENT", "true")  # banners; W&B warnings and errors still reach train.log
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")


class RunOutput:
    """Terminal + log file for one command. Use as a context manager; `console` is the terminal (stderr),
    `stdout` the original standard output.

    Without a log file (e.g. `--print-config`) nothing is redirected and records go to the terminal only."""

    def __init__(self, log_file: Path | None, verbose: bool = False, level: str = "INFO"):
        self.log_file, self.verbose, self.level = log_file, verbose, level.upper()
        self._saved: tuple[int, int] | None = None
        self._terminal = None
        self.console = Console(stderr=True)
        self.stdout = sys.stdout  # where a command's results go (a table others may pipe), not its log

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
        self.stdout = os.fdopen(os.dup(self._saved[0]), "w", buffering=1)
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


# ------------------------------------------------------------------------------------------ output folders
def first_missing(folder: Path) -> Path | None:
    """The outermost folder of `folder` (itself or a parent) that does not exist yet: what a command creates,
    and all it may move or remove again."""
    missing = None
    for candidate in [folder, *folder.parents]:
        if candidate.exists():
            break
        missing = candidate
    return missing


def remove_created(folder: Path, created: Path | None) -> None:
    """Remove `folder` and the parents a command created (`first_missing`), as long as they are empty."""
    shutil.rmtree(folder, ignore_errors=True)
    if created is None or created == folder:
        return
    for parent in folder.parents:
        try:
            parent.rmdir()
        except OSError:  # not empty (another run appeared) or gone
            return
        if parent == created:
            return


def move_to_failed(folder: Path) -> Path:
    """`<folder>` → `<folder>.failed` (its log kept for reading); an older `.failed` of the same name goes."""
    failed = folder.with_name(folder.name + ".failed")
    if failed.exists():
        shutil.rmtree(failed, ignore_errors=True)
    folder.rename(failed)
    return failed


def print_log_tail(console: Console, log_file: Path) -> None:
    """The end of a failed command's log, headed by its path (whole: a rule's title would be cut to the width)."""
    tail = log_tail(log_file)
    if tail:
        console.print(f"[dim]── end of {escape(str(log_file))} ──[/]", soft_wrap=True, highlight=False)
        for line in tail:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        console.rule(style="dim")


def show_failure(console: Console, exc: BaseException, log_file: Path) -> None:
    """A crash on the terminal: one `error:` line, then the end of the log (which holds the traceback)."""
    from epirl.config import first_line  # here: epirl.config imports torch, which `--help` need not load

    error_line(console, f"{type(exc).__name__}: {first_line(exc, '')}")
    print_log_tail(console, log_file)


def run_in_folder(out_dir: Path, log_name: str, verbose: bool, logger: logging.Logger,
                  body: Callable[[RunOutput], int]) -> int:
    """`body(out)` with everything libraries print in `out_dir/log_name`; returns its exit code.

    A crash or an interrupt moves a folder this command created to `<out_dir>.failed` (a folder that was
    there before is never moved) and names the log; a crash also prints its end (exit 1; interrupt 130)."""
    created = first_missing(out_dir)

    def keep_log() -> Path:
        out.restore()
        kept = move_to_failed(out_dir) if created is not None and out_dir.exists() else out_dir
        return kept / log_name

    with RunOutput(out_dir / log_name, verbose) as out:
        try:
            return body(out)
        except KeyboardInterrupt:
            logger.warning("interrupted", extra={"terminal": False})
            log_file = keep_log()
            out.console.print(f"[yellow]interrupted[/]: no results were written; log in {escape(str(log_file))}",
                              soft_wrap=True, highlight=False)
            return 130
        except Exception as exc:  # noqa: BLE001 - reported: one line and the end of the log
            logger.exception("failed", extra={"terminal": False})
            show_failure(out.console, exc, keep_log())
            return 1
