"""The console every command shares (epirl.console): a crash moves the output folder the command created to
`<out>.failed` and prints the end of its log; vLLM's error records stay in the log while epirl explains them in
one line; phase lines; `epirl compare` with its log in the study folder and the table on standard output."""

import argparse
import io
import logging
import os

import pytest
from rich.console import Console

from epirl.console import RunOutput, library_records_held, run_in_folder
from epirl.progress import PhaseProgress
from epirl.train_cli import missing_model_package

log = logging.getLogger("epirl.test")


# In-process, pytest's capture takes Python-level prints itself: libraries are modelled by fd-level writes
# (tests/test_console.py runs a subprocess for prints, warnings and loggers).
def crash(out):
    os.write(1, b"a library prints\n")
    os.write(2, b"C-level write\n")
    out.console.print("plan line")
    raise RuntimeError("engine died\nsecond line of the error")


def terminal_lines(capfd) -> list[str]:
    captured = capfd.readouterr()
    return [line for line in (captured.out + captured.err).splitlines() if line.strip()]


def test_a_crash_moves_the_new_folder_to_failed_and_prints_the_end_of_its_log(tmp_path, capfd):
    out_dir = tmp_path / "runs" / "eval-1"
    assert run_in_folder(out_dir, "eval.log", False, log, crash) == 1
    failed = tmp_path / "runs" / "eval-1.failed"
    lines = terminal_lines(capfd)
    assert lines[:2] == ["plan line", "error: RuntimeError: engine died"]
    assert f"end of {failed / 'eval.log'}" in lines[2]
    assert not out_dir.exists() and "second line of the error" in (failed / "eval.log").read_text()
    tail = "\n".join(lines[3:])
    assert "a library prints" in tail and "C-level write" in tail and "Traceback" in tail
    # the next crash of the same name replaces the older .failed
    (failed / "older").write_text("")
    assert run_in_folder(out_dir, "eval.log", False, log, crash) == 1
    assert not (failed / "older").exists() and (failed / "eval.log").is_file()


def test_a_folder_that_existed_before_is_never_moved(tmp_path, capfd):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "adapter").mkdir()
    assert run_in_folder(out_dir, "mismatch.log", False, log, crash) == 1
    assert (out_dir / "adapter").is_dir() and not (tmp_path / "out.failed").exists()
    assert f"end of {out_dir / 'mismatch.log'}" in "\n".join(terminal_lines(capfd))


def test_an_interrupt_keeps_the_log_and_says_where(tmp_path, capfd):
    def interrupted(out):
        raise KeyboardInterrupt

    assert run_in_folder(tmp_path / "out", "eval.log", False, log, interrupted) == 130
    assert terminal_lines(capfd) == [f"interrupted: no results were written; log in {tmp_path / 'out.failed' / 'eval.log'}"]


def test_success_shows_only_the_console_and_logs_the_rest(tmp_path, capfd):
    def body(out):
        os.write(1, b"library output\n")
        out.console.print("result line")
        print("result table", file=out.stdout)
        return 0

    assert run_in_folder(tmp_path / "out", "eval.log", False, log, body) == 0
    captured = capfd.readouterr()
    assert captured.err.splitlines() == ["result line"] and captured.out.splitlines() == ["result table"]
    assert "library output" in (tmp_path / "out" / "eval.log").read_text()


def test_vllm_error_records_stay_in_the_log_and_name_the_missing_package(tmp_path, capfd):
    subprocess_error = RuntimeError("Error raised in subprocess:\nTraceback (most recent call last):\n"
                                    "ModuleNotFoundError: No module named 'torchvision.transforms'")
    with RunOutput(tmp_path / "train.log"):
        with library_records_held() as records:
            logging.getLogger("vllm.model_executor.models.registry").error(
                "Error in inspecting model architecture 'Qwen3_5ForConditionalGeneration'", exc_info=subprocess_error)
            log.warning("epirl's own warning")
    assert terminal_lines(capfd) == ["warning: epirl's own warning"]
    assert "Error in inspecting model architecture" in (tmp_path / "train.log").read_text()
    refusal = ValueError("1 validation error for ModelConfig")
    assert missing_model_package(refusal, records) == ("Qwen3_5ForConditionalGeneration", "torchvision")
    assert missing_model_package(ValueError("max_num_batched_tokens must be >= max_model_len"), []) is None


def test_phase_lines_are_numbered_and_logged(caplog):
    buffer = io.StringIO()
    with caplog.at_level(logging.INFO), PhaseProgress(Console(file=buffer, width=200), "mismatch", 2) as phases:
        phases.start("bf16 engine: start, sample")
        phases.finished("bf16 engine: 32 tokens sampled in 1.0 s")
        phases.finished("trainer variants scored")
    assert buffer.getvalue().splitlines() == ["[1/2] bf16 engine: 32 tokens sampled in 1.0 s",
                                              "[2/2] trainer variants scored"]
    assert "bf16 engine: 32 tokens sampled in 1.0 s" in caplog.text


def test_compare_logs_in_the_study_folder_and_prints_the_table_on_stdout(tmp_path, capfd):
    from test_compare import RECIPE, fake_launcher

    from epirl.cli import build_parser
    from epirl.compare_cli import run_compare_command

    args = build_parser().parse_args(["compare", str(RECIPE), "--pairings", "bf16", "--seeds", "1",
                                      "--heldout-size", "20", "--resamples", "100", f"output_dir={tmp_path}",
                                      "rl.steps=3"])
    assert isinstance(args, argparse.Namespace)
    capfd.readouterr()
    assert run_compare_command(args, launcher=fake_launcher()) == 0
    captured = capfd.readouterr()
    study = tmp_path / "compare_smollm2_arith_cpu"
    assert captured.out.startswith("| pairing |")
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert err[0].startswith("compare ") and any(line.startswith("[1/1] bf16 s0: trained 3/3 steps") for line in err)
    assert (study / "compare.log").is_file() and (study / "summary.md").is_file()


@pytest.mark.parametrize("argv", [["--pairings", "nope"], ["--seeds", "0"]])
def test_compare_bad_input_writes_no_folder(tmp_path, capfd, argv):
    from test_compare import RECIPE

    from epirl.cli import main

    assert main(["compare", str(RECIPE), f"output_dir={tmp_path}", *argv]) == 2
    assert len(terminal_lines(capfd)) == 1 and os.listdir(tmp_path) == []


def test_a_warning_about_an_optional_module_is_not_the_reason():
    warning = logging.LogRecord("vllm", logging.WARNING, __file__, 1, "No module named 'vllm._C'", None, None)
    assert missing_model_package(ValueError("max_num_batched_tokens is too small"), [warning]) is None


def test_compare_bar_counts_a_run_once_its_evaluation_is_done(tmp_path):
    from test_compare import fake_launcher, make_spec

    from epirl.compare.plan import plan_study
    from epirl.compare.study import run_study
    from epirl.compare_cli import StudyProgress

    spec = make_spec(tmp_path, pairings="bf16", seeds="2")
    plan = plan_study(spec)
    launches = []

    def launcher(launch):
        launches.append((launch.kind, progress.bar.tasks[0].completed))
        return fake_launcher()(launch)

    progress = StudyProgress(launcher, 2, Console(file=io.StringIO(), force_terminal=True, width=200))
    assert run_study(spec, Console(file=io.StringIO()), progress, on_run_done=progress.run_done) == 0
    # each run: training (bar unchanged), then its held-out evaluation (the run counts after it)
    assert launches == [("train", 0), ("eval", 0), ("train", 1), ("eval", 1)]
    assert progress.bar.tasks[0].completed == 2 and progress.live == []
