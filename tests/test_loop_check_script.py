"""The GPU loop check's verdict (scripts/gpu_loop_check.py): what makes it exit 1, decided from the runs' rows."""

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def check():
    return load_script("gpu_loop_check")


def _row(pairing, fault=None, steps=20, rc=0, probe_stop=False, kl=(2e-3, 2e-3, 2e-3)):
    return {"pairing": pairing, "fault": fault, "rc": rc, "seconds": 100.0, "probe_stop": probe_stop, "steps": steps,
            "kl": list(kl), "resolved_old": 2, "resolved_base": 15, "beta_old": (1.0, 0.9), "plain_old": (0.9, 0.8),
            "reliability_old": (0.9, 0.85), "beta_base": (1.0, 0.95), "acc": (0.1, 0.5)}


def test_a_healthy_table_passes_and_prints_every_row(check):
    rows = [_row("bf16"), _row("w8a16", kl=(2e-3, 2.3e-3, 2e-3)), _row("w8a8"),
            _row("w8a16", "skip", steps=5, rc=1, probe_stop=True)]
    assert check.verdict(rows, 20, 2e-3) == []
    text = check.table(rows, 2e-3)
    assert len(text.splitlines()) == 2 + len(rows) and "fault `skip`" in text and "**yes**" in text


@pytest.mark.parametrize("rows,problem", [
    ([_row("w8a16", kl=(2e-3, 2.5e-3, 3e-3))], "1.25x the bf16 pairing's"),
    ([_row("w8a8", steps=4, rc=1, probe_stop=True)], "4 of 20 steps, rc 1 (probe stop)"),
    ([_row("bf16", steps=0, rc=1)], "0 of 20 steps"),
    ([_row("w8a16", "stale", steps=10, probe_stop=False)], "fault stale in w8a16: not stopped by the probe"),
])
def test_what_fails_the_check(check, rows, problem):
    problems = check.verdict(rows, 20, 2e-3)
    assert len(problems) == 1 and problem in problems[0], problems


def test_unknown_pairing_is_refused_with_one_line(check, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["gpu_loop_check.py", "--pairings", "bf16,nope"])
    with pytest.raises(SystemExit) as exit_:
        check.main()
    assert exit_.value.code == 2 and "unknown ['nope']" in capsys.readouterr().err


def test_faults_follow_their_pairing_in_one_chain(check):
    work = check.chains(["bf16", "w8a16", "w8a8"], ["skip", "stale", "skip-w8a8"])
    assert work == [[("bf16", None)], [("w8a16", None), ("w8a16", "skip"), ("w8a16", "stale")],
                    [("w8a8", None), ("w8a8", "skip-w8a8")]]
    assert check.chains(["bf16"], ["skip"]) == [[("bf16", None)], [("w8a16", "skip")]]


def test_chains_run_side_by_side_and_rows_come_back_in_table_order(check, monkeypatch, capsys):
    import threading
    import time
    live, peak, lock = [0], [0], threading.Lock()

    def fake_run(args, pairing, fault=None):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.05 if fault else 0.2)  # pairings end after the other chains' first runs
        with lock:
            live[0] -= 1
        return _row(pairing, fault)

    monkeypatch.setattr(check, "run_pairing", fake_run)
    args = type("Args", (), {"jobs": 0})()
    rows = check.run_chains(args, check.chains(["bf16", "w8a16", "w8a8"], ["skip", "skip-w8a8"]))
    assert [(r["pairing"], r["fault"]) for r in rows] == [("bf16", None), ("w8a16", None), ("w8a8", None),
                                                        ("w8a16", "skip"), ("w8a8", "skip-w8a8")]
    assert peak[0] == 3 and len(capsys.readouterr().out.splitlines()) == 5
    args.jobs = 1
    live[0] = peak[0] = 0
    check.run_chains(args, check.chains(["bf16", "w8a16"], []))
    assert peak[0] == 1
