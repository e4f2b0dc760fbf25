"""CUDA-graph replay timer with an L2 flush before each call: what the benchmarks and the timed dispatch use, so
small-M kernels are timed without Python launch overhead and without a warm L2 (kernels/README.md § Performance).

The flush reads a 256 MB buffer: the L2 is then full of clean lines, which the timed call evicts for free. A flush
that writes the buffer (what `triton.testing.do_bench` does; `l2_flush(..., "write")`) leaves the L2 full of dirty
lines, so the timed call also pays for writing back as many bytes as it brought in (up to the L2's ~50 MB), i.e. up
to twice a decode kernel's traffic, which the subtracted flush-only time does not remove. Numbers measured with the
two flushes are not comparable.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

_FLUSH: dict[str, torch.Tensor] = {}
FLUSH_BYTES = 256 * 2 ** 20
FLUSH_MODE = "read"


def flush_mode() -> str:
    """The timer's L2 flush ("read"; the benchmarks print it beside their numbers)."""
    return FLUSH_MODE


def l2_flush(buf: torch.Tensor, sink: torch.Tensor, mode: str) -> None:
    """Evict the L2 by streaming `buf` through it: read (amax into `sink`, clean lines) or write (zero it)."""
    if mode == "write":
        buf.zero_()
    else:
        torch.amax(buf, dim=0, keepdim=True, out=sink)


REPLAYS = 7  # timed replays of a graph (graph_us) or rounds (graph_us_interleaved); the median is kept


def _capture(body: Callable[[], object], reps: int, pool=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `reps` calls of body, replayed once (the first replay pays for the upload)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up outside capture: compiles kernels, fills allocator pools
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for _ in range(reps):
            body()
    graph.replay()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _graph_ms(body: Callable[[], object], reps: int) -> float:
    graph = _capture(body, reps)
    times = sorted(_replay_ms(graph) for _ in range(REPLAYS))
    del graph
    return times[REPLAYS // 2]


def _flush_buffers() -> tuple[torch.Tensor, torch.Tensor]:
    if "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        _FLUSH["sink"] = torch.zeros(1, dtype=torch.int32, device="cuda")
    return _FLUSH["buf"], _FLUSH["sink"]


def graph_us(fn: Callable[[], object], reps: int = 10, flush: bool = True) -> float:
    """Median per-call GPU time (µs) of fn replayed from a CUDA graph, the L2 flushed before each call (see the
    module docstring; the flush alone is timed in its own graph and subtracted)."""
    if not flush:
        return _graph_ms(fn, reps) * 1e3 / reps
    mode = flush_mode()
    buf, sink = _flush_buffers()

    def flush_only():
        l2_flush(buf, sink, mode)

    def flushed():
        l2_flush(buf, sink, mode)
        fn()

    return max(_graph_ms(flushed, reps) - _graph_ms(flush_only, reps), 0.0) * 1e3 / reps


def graph_us_interleaved(fns: Sequence[Callable[[], object]], reps: int = 10, flush: bool = True) -> list[float]:
    """Per-call GPU time (µs) of each of fns as `graph_us` measures it, with all their graphs captured first and
    replayed in turn: each of REPLAYS rounds replays every fn's graph once (and the flush-only graph), and a fn's
    time is its median over the rounds of its replay less that round's flush. Clock and power drift over the seconds
    a tuner spends on one table entry then reaches every candidate alike instead of favouring the one that ran in a
    fast stretch (on an H100 one config timed 1556 µs and 1349 µs a minute apart). The graphs share one memory pool: they replay one at a time, in capture order, and keep no outputs."""
    bodies = list(fns)
    if flush:
        mode = flush_mode()
        buf, sink = _flush_buffers()

        def flushed(fn):
            def body():
                l2_flush(buf, sink, mode)
                fn()
            return body

        bodies = [flushed(fn) for fn in fns] + [lambda: l2_flush(buf, sink, mode)]
    pool = torch.cuda.graph_pool_handle()
    graphs = [_capture(body, reps, pool) for body in bodies]
    rounds = [[_replay_ms(graph) for graph in graphs] for _ in range(REPLAYS)]
    del graphs
    base = [r[-1] if flush else 0.0 for r in rounds]
    return [max(statistics.median(r[i] - b for r, b in zip(rounds, base)), 0.0) * 1e3 / reps for i in range(len(fns))]


def release() -> None:
    """Free the L2-flush buffer (256 MB): an engine times once at start and must not keep it."""
    _FLUSH.clear()
    torch.cuda.empty_cache()
