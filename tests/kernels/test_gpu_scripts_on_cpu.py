"""The GPU tuning and measurement scripts run end to end on CPU (kernels in Triton's interpreter, wall-clock
timer): a Python error in them is found here, not in a device call."""

from pathlib import Path

import pytest

from conftest import check_interpreter_case, run_interpreter_cases

pytest.importorskip("triton")

CASES = ["tune_writes_a_bitwise_checked_table", "tune_gluon_only_keeps_the_tables_tiles", "one_chunk_study_prints_both_tables",
         "bits_report_finds_every_config_equal", "bench_kernels_forward_table", "tenants_bench_rows_and_table",
         "trainer_profile_prints_wall_kernels_and_host", "bench_kernels_trainer_row_and_table",
         "chunk_probe_row_restores_the_chunking",
         "read_floor_kernel_reads_every_word", "read_floor_bench_prints_its_tables", "race_count_finds_no_wrong_call"]


@pytest.fixture(scope="module")
def results():
    return run_interpreter_cases(Path(__file__).with_name("gpu_scripts_cases.py"), CASES)


@pytest.mark.parametrize("case", CASES)
def test_gpu_script_runs_on_cpu(results, case):
    check_interpreter_case(results, case)
