"""The main of the kernel case scripts that tests run in a subprocess (interpreter_cases.py and the invariant_*_cases.py
scripts): run the named cases (all when none is named) and print one JSON line per case, {"case", "ok", "error"}, which
`run_interpreter_cases` in tests/conftest.py collects."""

import json
import traceback
from typing import Callable


def run_cases(cases: dict[str, Callable[[], None]], names: list[str]) -> None:
    for name in names or list(cases):
        try:
            cases[name]()
            record = {"case": name, "ok": True}
        except Exception:  # report every case, keep going
            record = {"case": name, "ok": False, "error": traceback.format_exc()[-3000:]}
        print(json.dumps(record), flush=True)
