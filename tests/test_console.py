"""The quiet console (library output to train.log, the terminal for epirl), step lines, resume, the summary,
reward.png, and which sources are paths and which are hub ids."""

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
from rich.console import Console

from epirl import hub
from epirl.data import DataError, read_records
from epirl.plot import sparkline, write_reward_plot
from epirl.progress import RunProgress, step_line


def test_library_output_goes_to_train_log_and_only_epirl_reaches_the_terminal(tmp_path):
    """What libraries print from Python, warnings, loggers and C-level writes to fd 1/2 land in train.log."""
    script = textwrap.dedent(f"""
        import logging, os, sys, warnings
        from pathlib import Path
        from epirl.console import RunOutput
        with RunOutput(Path({str(tmp_path / 'train.log')!r})) as out:
            print("library print")
            os.write(2, b"C-level write to fd 2\\n")
            warnings.warn("a FutureWarning", FutureWarning)
            logging.getLogger("vllm.engine").info("engine config dump")
            logging.getLogger("vllm.engine").warning("vllm warning")
            logging.getLogger("epirl.x").info("epirl info, log only")
            logging.getLogger("epirl.x").warning("epirl warning")
            logging.getLogger("epirl.x").error("said by the CLI itself", extra={{"terminal": False}})
            out.console.print("plan line")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == ["warning: epirl warning", "plan line"]
    log = (tmp_path / "train.log").read_text()
    for text in ("library print", "C-level write to fd 2", "a FutureWarning", "engine config dump", "vllm warning",
                 "epirl info, log only", "epirl warning", "said by the CLI itself"):
        assert text in log, text


def metrics(acc, kl=None):
    row = {"reward/accuracy": acc, "reward/mean": acc, "response/length_mean": 10.0, "rollout/groups_generated": 2.0,
           "time/generate_s": 2.0, "time/train_s": 1.0, "time/step_s": 3.0, "train/skipped": 0.0}
    if kl is not None:
        row["mismatch/k3_kl"] = kl
    return row


def test_step_lines_plot_and_summary(tmp_path):
    buffer = io.StringIO()
    observer = RunProgress(Console(file=buffer, width=200), tmp_path, total_steps=3, samples_per_prompt=4)
    observer.started(0, {"static_bytes": 2**30})
    for step, acc in enumerate((0.25, 0.5, 0.75), start=1):
        observer(step, metrics(acc, kl=1e-4 * step))
    observer.print_summary(tmp_path)
    lines = buffer.getvalue().splitlines()
    assert lines[0].startswith("ready in") and "trainer holds 1.00 GiB" in lines[0]
    assert lines[1].startswith("step 1/3  acc 0.250  reward +0.250  len 10  kl 1.0e-04")
    assert lines[3].startswith("step 3/3  acc 0.750")
    assert lines[4].startswith("done in")
    assert lines[5].startswith("accuracy 0.250 → 0.750 (step 1 → 3, best 0.750)")
    assert lines[6] == "reward   +0.250 → +0.750"
    assert lines[7].startswith("tokens   240 generated: 40 tok/s while generating")  # 3 × 10 tokens × 2 groups × 4
    assert "generate" in lines[8] and "train" in lines[8]
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_starts_the_bar_at_the_resumed_step_and_keeps_the_earlier_rows(tmp_path):
    with (tmp_path / "metrics.jsonl").open("w") as fh:
        for step in (1, 2, 3):  # step 3 ran after the checkpoint at 2: it runs again and is not the past
            fh.write(json.dumps({"step": step, **metrics(0.1 * step)}) + "\n")
        fh.write('{"step": 4, "reward/acc')  # torn by the crash
    buffer = io.StringIO()
    observer = RunProgress(Console(file=buffer, width=200), tmp_path, total_steps=5, start_step=2)
    assert [row["step"] for row in observer.rows] == [1, 2]
    observer.started(2, {})
    assert observer.bar.tasks[0].completed == 2
    assert "resuming after step 2" in buffer.getvalue()
    observer(3, metrics(0.9))
    assert observer.bar.tasks[0].completed == 3
    observer.print_summary(tmp_path)
    assert "accuracy 0.100 → 0.900 (step 1 → 3" in buffer.getvalue()


def test_reward_plot_and_sparkline(tmp_path):
    rows = [{"step": s, **metrics(a)} for s, a in ((1, 0.1), (2, float("nan")), (3, 0.4))]
    write_reward_plot(rows, tmp_path / "reward.png")
    assert (tmp_path / "reward.png").stat().st_size > 1000 and not list(tmp_path.glob("*.tmp*"))
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█" and sparkline([1.0, 1.0]) == "▁▁" and sparkline([]) == ""
    assert len(sparkline([float(i) for i in range(100)])) == 40


def test_step_line_says_when_no_update_happened():
    line = step_line(2, 10, {**metrics(0.0), "train/skipped": 1.0})
    assert "no update (equal rewards)" in line and "kl" not in line


def test_step_line_shows_the_bitwise_fraction_only_where_some_tokens_agree_bit_for_bit():
    assert "bitwise" not in step_line(1, 3, {**metrics(0.5, kl=2e-3), "mismatch/bitwise_frac": 0.0})
    line = step_line(1, 3, {**metrics(0.5, kl=0.0), "mismatch/bitwise_frac": 1.0})
    assert "kl 0.0e+00  bitwise 1.000" in line


@pytest.mark.parametrize("source, is_id", [
    ("BytedTsinghua-SIA/DAPO-Math-17k", True), ("AI-MO/NuminaMath-1.5", True), ("org/name:config", True),
    ("mydata/train", True), ("mydata/train.jsonl", False), ("./mydata/train", False), ("~/data/x", False),
    ("/data/x", False), ("a/b/c", False), ("train.parquet", False), ("arith", False),
])
def test_hub_ids_are_only_org_slash_name(source, is_id):
    assert hub.is_hub_id(source) is is_id


def test_an_existing_first_folder_makes_org_name_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mydata").mkdir()
    assert not hub.is_hub_id("mydata/train")
    with pytest.raises(DataError, match=r"^data.source: no such file: mydata/train$"):
        read_records("mydata/train")
    with pytest.raises(DataError, match=r"^data.source: mydata is a folder"):
        read_records("mydata")


def test_an_unreachable_hub_is_one_line_before_any_lookup(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    hub.unreachable_reason.cache_clear()
    try:
        with pytest.raises(DataError, match=r"^data.source: org/name: no such local file or folder, and as a hub id "
                                            r"it cannot be fetched: http://127.0.0.1:9 is unreachable"):
            read_records("org/name")
    finally:
        hub.unreachable_reason.cache_clear()
    assert os.environ.get("HF_HUB_OFFLINE") is None
