"""scripts/sass_report.py compiles the W8A16 kernel for sm_90a without a GPU: its K loop reaches Hopper's wgmma
(HGMMA), in the forward and the dX, and the report reads registers and spills."""

import os
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def _have_tools() -> bool:
    import sass_report
    return all(os.access(sass_report._tool(t), os.X_OK) for t in ("cuobjdump", "ptxas"))


@pytest.mark.parametrize("dx", [False, True])
def test_kernel_compiles_for_sm90_with_wgmma_in_the_k_loop(dx):
    import sass_report
    if not _have_tools():
        pytest.skip("this triton ships no ptxas/cuobjdump")
    r = sass_report.report(sass_report.compile_cubin("128/128/64/8/3", False, dx))
    assert r["HGMMA"] >= 1 and 0 < r["regs"] <= 255 and r["loop"] > 0, r
    assert r["LDL"] == 0 and r["STL"] == 0, f"spill traffic inside the K loop: {r}"
