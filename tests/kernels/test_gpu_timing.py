"""The benchmark timer's L2 flush (epirl.kernels.gpu_timing) on CPU tensors: the read flush reads every element and
writes only its one-element sink (so it leaves no dirty lines behind), the write flush overwrites the buffer, and
the setting is validated. Timing itself needs CUDA (the GPU benchmarks)."""

import pytest
import torch

from epirl.kernels import gpu_timing


def test_read_flush_reads_every_element_and_writes_only_the_sink():
    buf = torch.arange(1000, dtype=torch.int32)
    sink = torch.zeros(1, dtype=torch.int32)
    gpu_timing.l2_flush(buf, sink, "read")
    assert sink.item() == 999 and torch.equal(buf, torch.arange(1000, dtype=torch.int32))
    gpu_timing.l2_flush(buf, sink, "write")
    assert not buf.any()


def test_flush_mode_defaults_to_read_and_rejects_typos(monkeypatch):
    monkeypatch.delenv(gpu_timing.FLUSH_ENV, raising=False)
    assert gpu_timing.flush_mode() == "read"
    monkeypatch.setenv(gpu_timing.FLUSH_ENV, "write")
    assert gpu_timing.flush_mode() == "write"
    monkeypatch.setenv(gpu_timing.FLUSH_ENV, "clean")
    with pytest.raises(ValueError, match="EPIRL_L2_FLUSH"):
        gpu_timing.flush_mode()
