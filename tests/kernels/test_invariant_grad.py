"""The trainer's gradients through the invariant ops' Triton forwards (kernels/invariant/ops.py) agree with autograd
through the float64 references: run in Triton's CPU interpreter (invariant_grad_cases.py, one subprocess)."""

from pathlib import Path

import pytest

from conftest import check_interpreter_case, run_interpreter_cases

SCRIPT = Path(__file__).with_name("invariant_grad_cases.py")
CASES = ["rms_norm", "rotary", "silu_mul", "attention", "head"]


@pytest.fixture(scope="module")
def grad_results():
    return run_interpreter_cases(SCRIPT, CASES)


@pytest.mark.parametrize("case", CASES)
def test_gradient_through_the_triton_forward(grad_results, case):
    check_interpreter_case(grad_results, case)
