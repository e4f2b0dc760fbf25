"""scripts/profile_step_gaps.py's accounting on a synthetic trace: busy time is the union of overlapping kernels, every
gap between them is idle time, and a gap goes to the innermost / outermost host op open when it starts."""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import profile_step_gaps as gaps  # noqa: E402

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def event(name, device_type, start, end):
    return SimpleNamespace(name=name, device_type=device_type, time_range=SimpleNamespace(start=start, end=end))


def test_busy_intervals_merge_overlaps():
    assert gaps.busy_intervals([(50, 60), (0, 10), (5, 20), (20, 25)]) == [(0, 25), (50, 60)]


def test_gaps_go_to_the_host_ops_open_when_they_start(capsys):
    trace = [
        event("k1", CUDA, 0, 10), event("k2", CUDA, 5, 20),  # overlapping kernels: busy 0-20
        event("k3", CUDA, 50, 60),  # a 30 µs gap while the host syncs
        event("k4", CUDA, 62, 70),  # a 2 µs gap: below --min-gap-us
        event("k5", CUDA, 100, 110),  # a 30 µs gap in a Python backward, no op inside it at that moment
        event("training_step", CPU, 0, 200),
        event("aten::item", CPU, 18, 55), event("cudaStreamSynchronize", CPU, 19, 54),
        event("autograd::engine::evaluate_function: Fp8LoRAFunctionBackward", CPU, 65, 120),
        event("cudaLaunchKernel", CPU, 69, 71),  # launch calls are not host work that delays a kernel
    ]
    gaps.gap_report(SimpleNamespace(events=lambda: trace), min_gap_us=5, top=10)
    out = capsys.readouterr().out
    assert "GPU busy 0.0 ms (43.6%)" in out and "in 3 gaps (2 >= 5 µs)" in out  # 48 of 110 µs busy
    assert "| `cudaStreamSynchronize` | 0.03 | 1 |" in out
    assert "| `autograd::engine::evaluate_function: Fp8LoRAFunctionBackward` | 0.03 | 1 |" in out
    assert "| `(gaps below --min-gap-us)` | 0.00 | - |" in out
    assert "| 30 | `cudaStreamSynchronize` | `training_step` |" in out
