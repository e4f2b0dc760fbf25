"""The GPU tuning and measurement scripts run end to end on CPU (kernels in Triton's interpreter, wall-clock
timer): a Python error in them is found here, not in a device call."""

from pathlib import Path

import pytest

from conftest import check_interpreter_case, run_interpreter_cases

pytest.importorskip("triton")

CASES = ["tune_writes_a_bitwise_checked_table", "tune_gluon_only_keeps_the_tables_tiles", "bench_kernels_forward_table",
         "tenants_bench_rows_and_table", "bench_kernels_trainer_row_and_table", "bench_fused_slices_rows_and_tables",
         "bench_invariant_table"]


@pytest.fixture(scope="module")
def results():
    return run_interpreter_cases(Path(__file__).with_name("gpu_scripts_cases.py"), CASES)


@pytest.mark.parametrize("case", CASES)
def test_gpu_script_runs_on_cpu(results, case):
    check_interpreter_case(results, case)
