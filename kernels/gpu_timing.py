"""CUDA-graph replay timer with an L2 flush before each call: what the benchmarks and the timed dispatch use, so
small-M kernels are timed without Python launch overhead and without a warm L2 (kernels/README.md § Performance)."""

from __future__ import annotations

from collections.abc import Callable

import torch

_FLUSH: dict[str, torch.Tensor] = {}
FLUSH_BYTES = 256 * 2 ** 20


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
    """Median per-call GPU time (µs) of fn replayed from a CUDA graph, the L2 flushed before each call
    (the flush alone is timed in its own graph and subtracted)."""
    if not flush:
        return _graph_ms(fn, reps) * 1e3 / reps
    buf = _FLUSH.setdefault("buf", torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda"))

    def flushed():
        buf.zero_()
        fn()

    return max(_graph_ms(flushed, reps) - _graph_ms(buf.zero_, reps), 0.0) * 1e3 / reps


def release() -> None:
    """Free the L2-flush buffer (256 MB): an engine times once at start and must not keep it."""
    _FLUSH.clear()
    torch.cuda.empty_cache()
