"""The invariant Triton attention in Triton's CPU interpreter: agreement with the float64 reference, and the bitwise
pairing's contract (a row's bits do not depend on the batch, the tile, the paged layout, or whole / chunked prefill
vs decode). The cases run in two subprocesses at once (TRITON_INTERPRET must be set before triton is imported; the
interpreter is slow, and the two groups take about as long)."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import check_interpreter_case, run_interpreter_cases

pytest.importorskip("triton")

GROUPS = [["batched_rows_do_not_depend_on_the_batch", "chunked_prefill_and_decode_mixed",
           "masked_key_blocks_are_noops", "empty_requests_and_length_one"],
          ["matches_reference", "whole_prefill_paged_equals_batched", "decode_steps"]]
CASES = [case for group in GROUPS for case in group]
SCRIPT = Path(__file__).with_name("invariant_attention_cases.py")


@pytest.fixture(scope="module")
def interpreter_results():
    with ThreadPoolExecutor(len(GROUPS)) as pool:
        results = {}
        for part in pool.map(lambda group: run_interpreter_cases(SCRIPT, group), GROUPS):
            results.update(part)
    return results


@pytest.mark.parametrize("case", CASES)
def test_invariant_attention_in_interpreter(interpreter_results, case):
    check_interpreter_case(interpreter_results, case)
