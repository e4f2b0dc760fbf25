"""The split-K ticket counters' workspace (`kernels/w8a16/ws_splitk.py`): kept per device and role, made zeroed by
work that runs, never kept when first asked for inside a CUDA-graph capture, never freed once a graph may hold it.
The capture is stood in for by `_capturing` (CPU has none); the GPU test of the same contract under real captures is
`test_graph_decoder_gpu.py`."""

import pytest
import torch

from epirl.kernels.w8a16 import ws_splitk

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def empty_workspaces(monkeypatch):
    monkeypatch.setattr(ws_splitk, "_COUNTERS", {})
    monkeypatch.setattr(ws_splitk, "_RETIRED", [])


def test_one_workspace_per_role_reused_across_calls():
    base = ws_splitk._counters(CPU, "base", 100)
    assert base.dtype == torch.int32 and base.numel() == ws_splitk.COUNTER_SLOTS and not base.any()
    assert ws_splitk._counters(CPU, "base", 5) is base
    assert ws_splitk._counters(CPU, "down", 5) is not base


def test_first_use_inside_a_capture_is_not_kept(monkeypatch):
    monkeypatch.setattr(ws_splitk, "_capturing", lambda device: True)
    one, two = ws_splitk._counters(CPU, "base", 8), ws_splitk._counters(CPU, "base", 8)
    assert one is not two and not one.any() and not ws_splitk._COUNTERS


def test_a_capture_uses_the_reserved_workspace(monkeypatch):
    ws_splitk.reserve_counters(CPU)
    reserved = dict(ws_splitk._COUNTERS)
    assert sorted(role for _, role in reserved) == sorted(ws_splitk.ROLES)
    monkeypatch.setattr(ws_splitk, "_capturing", lambda device: True)
    assert ws_splitk._counters(CPU, "down", 64) is reserved[(CPU, "down")]
    with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        ws_splitk.reserve_counters(CPU)


def test_growth_keeps_the_outgrown_workspace_alive():
    small = ws_splitk._counters(CPU, "base", 1)
    big = ws_splitk._counters(CPU, "base", ws_splitk.COUNTER_SLOTS + 1)
    assert big.numel() == ws_splitk.COUNTER_SLOTS + 1 and ws_splitk._RETIRED == [small]
