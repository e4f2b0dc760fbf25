"""scripts/offline/device_bg.sh on CPU: a job started in its own session outlives the starting shell, `wait` reports it
running (exit 99) and then ended (its exit status), and puts the job's log and a tarball of its $OUT into the
caller's $OUT."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "offline" / "device_bg.sh"


def bg(home: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "OUT": str(out)}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=60)


def test_job_survives_the_start_call_and_wait_returns_its_status_and_files(tmp_path):
    go = tmp_path / "go"  # the job runs until the test creates this file
    job = f"while [ ! -f {go} ]; do sleep 0.1; done; echo done > $OUT/result.txt; echo finished; exit 3"
    started = bg(tmp_path / "home", tmp_path / "out0", "start", "j", "bash", "-c", job)
    assert started.returncode == 0 and "[bg j] started" in started.stdout, started.stderr
    running = bg(tmp_path / "home", tmp_path / "out1", "wait", "j", "0")
    assert running.returncode == 99 and "still running" in running.stdout
    go.touch()
    t0 = time.time()
    ended = bg(tmp_path / "home", tmp_path / "out2", "wait", "j", "30")
    assert ended.returncode == 3 and "ended, exit 3" in ended.stdout and "finished" in ended.stdout
    assert time.time() - t0 < 30
    assert "finished" in (tmp_path / "out2" / "bg_j.log").read_text()
    with tarfile.open(tmp_path / "out2" / "bg_j_out.tgz") as tar:
        assert tar.extractfile("./result.txt").read() == b"done\n"
    # the job ran in a copy of the repository (later calls may re-sync the working tree under it)
    assert (tmp_path / "home" / "bg" / "j" / "repo" / "scripts" / "offline" / "device_bg.sh").is_file()


def test_unknown_subcommand_is_one_line_and_exit_2(tmp_path):
    result = bg(tmp_path, tmp_path / "out", "stop", "j")
    assert result.returncode == 2 and "unknown subcommand" in result.stdout
