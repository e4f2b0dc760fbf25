"""The benchmark timer's L2 flush (epirl.kernels.gpu_timing) on CPU tensors: the read flush reads every element and
writes only its one-element sink (so it leaves no dirty lines behind), the write flush overwrites the buffer. Timing itself needs CUDA (the GPU benchmarks)."""

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


def test_timer_flushes_by_reading():
    assert gpu_timing.flush_mode() == "read"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_interleaved_timer_orders_work_and_agrees_with_graph_us():
    """graph_us_interleaved times each fn as graph_us does: a 4x larger matmul takes ~4x as long (compute-bound,
    loose bounds: this checks the bookkeeping of rounds and flush, not the GPU), the same fn twice gets the same
    time within noise, and both agree with graph_us; without the flush too."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    wide = torch.randn(4096, 16384, device="cuda", dtype=torch.bfloat16)
    small, big = (lambda: a @ b), (lambda: a @ wide)
    for flush in (True, False):
        t_small, t_again, t_big = gpu_timing.graph_us_interleaved([small, small, big], flush=flush)
        alone = gpu_timing.graph_us(small, flush=flush)
        assert 2.5 < t_big / t_small < 6.0, (t_small, t_big)
        assert abs(t_again - t_small) < 0.15 * t_small, (t_small, t_again)
        assert abs(alone - t_small) < 0.25 * alone, (alone, t_small)
    assert gpu_timing.graph_us_interleaved([]) == []
