"""CUDA-graph replay timer with an L2 flush before each call: what the benchmarks and the timed dispatch use, so
small-M kernels are timed without Python launch overhead and without a warm L2 (kernels/README.md § Performance).

The flush reads a 256 MB buffer (`EPIRL_L2_FLUSH=read`, the default since 2026-12-01): the L2 is then full of clean
lines, which the timed call evicts for free. The earlier flush wrote the buffer (`EPIRL_L2_FLUSH=write`, what
`triton.testing.do_bench` does): it leaves the L2 full of dirty lines, so the timed call also paid for writing back
as many bytes as it brought in (up to the L2's ~50 MB), i.e. up to twice a decode kernel's traffic, which the
subtracted flush-only time does not remove. Numbers measured with the two flushes are not comparable.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

_FLUSH: dict[str, torch.Tensor] = {}
FLUSH_BYTES = 256 * 2 ** 20
FLUSH_ENV = "EPIRL_L2_FLUSH"


def flush_mode() -> str:
    mode = os.environ.get(FLUSH_ENV, "read")
    if mode not in ("read", "write"):
        raise ValueError(f"{FLUSH_ENV}={mode!r}: expected read or write")
    return mode


def l2_flush(buf: torch.Tensor, sink: torch.Tensor, mode: str) -> None:
    """Evict the L2 by streaming `buf` through it: read (amax into `sink`, clean lines) or write (zero it)."""
    if mode == "write":
        buf.zero_()
    else:
        torch.amax(buf, dim=0, keepdim=True, out=sink)


def _graph_ms(body: Callable[[], object], reps: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up outside capture: compiles kernels, fills allocator pools
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            body()
    graph.replay()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[3]


def graph_us(fn: Callable[[], object], reps: int = 10, flush: bool = True) -> float:
    """Median per-call GPU time (µs) of fn replayed from a CUDA graph, the L2 flushed before each call (see the
    module docstring; the flush alone is timed in its own graph and subtracted)."""
    if not flush:
        return _graph_ms(fn, reps) * 1e3 / reps
    mode = flush_mode()
    if "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        _FLUSH["sink"] = torch.zeros(1, dtype=torch.int32, device="cuda")
    buf, sink = _FLUSH["buf"], _FLUSH["sink"]

    def flush_only():
        l2_flush(buf, sink, mode)

    def flushed():
        l2_flush(buf, sink, mode)
        fn()

    return max(_graph_ms(flushed, reps) - _graph_ms(flush_only, reps), 0.0) * 1e3 / reps


def release() -> None:
    """Free the L2-flush buffer (256 MB): an engine times once at start and must not keep it."""
    _FLUSH.clear()
    torch.cuda.empty_cache()
