"""The invariant row kernels (`epirl.kernels.invariant.triton_rows`: RMSNorm, rotary, SiLU-and-mul, logits,
log-softmax, token log-probs) in Triton's CPU interpreter: close to the float64 references, each row's bits
independent of the batch, outputs fully written, token_logprobs bit-equal to log_softmax gathered (one subprocess,
because TRITON_INTERPRET must be set before triton decorates the kernels; the cases are in invariant_rows_cases.py).
The GPU twins at real sizes are in test_invariant_triton_rows_gpu.py."""

from pathlib import Path

import pytest

from conftest import check_interpreter_case, run_interpreter_cases

pytest.importorskip("triton")

CASES = ["rms_norm", "rotary", "silu_mul", "logits", "log_softmax_and_token_logprobs", "empty_and_tiny"]
SCRIPT = Path(__file__).with_name("invariant_rows_cases.py")


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_cases(SCRIPT, CASES)


@pytest.mark.parametrize("case", CASES)
def test_invariant_row_kernel_in_interpreter(interpreter_results, case):
    check_interpreter_case(interpreter_results, case)


def test_configs_depend_on_the_width_only():
    """The one config of each op is a function of its width (no row count enters it), and widths that need it get
    the chunked forms."""
    from epirl.kernels.invariant import triton_rows as tr

    assert tr.norm_config(4096) == dict(BLOCK=4096, N_CHUNKS=1, num_warps=8)
    assert tr.norm_config(9000)["N_CHUNKS"] == 2
    assert tr.lse_config(151936) == dict(BLOCK_V=4096, N_TILES=38, TILES_BLOCK=64, num_warps=16)
    assert tr.rotary_config(32, 128, 128)["BLOCK_H"] == 32
    assert tr._row_align(4096, 2) == 8 and tr._row_align(100, 2) == 4 and tr._row_align(777, 4) == 1
