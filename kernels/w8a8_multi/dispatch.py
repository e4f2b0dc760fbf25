"""Timed dispatch: for each projection shape and token bucket, time the candidate implementations once (CUDA-graph
replays, L2 flushed), keep the fastest, log the table and cache it on disk keyed by GPU, vLLM version and shapes,
so a restart does not re-time. Pure logic: the timer and the candidates are injected (CPU-testable); timing.py
holds the GPU timer and `gpu_candidates` the GPU candidates.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BUCKETS = (1, 4, 8, 16, 32, 64, 256, 1024, 4096)
CACHE_VERSION = 1


@dataclass(frozen=True)
class Shape:
    """One projection: its name (e.g. qkv_proj), input K, output N, the adapter rank r, and how many adapters the
    timed batches spread their tokens over (the engine's adapter slots: a batch of M tokens is timed with
    min(adapters, M) distinct adapters, the mix a server with that many slots is configured for)."""
    name: str
    K: int
    N: int
    r: int
    adapters: int = 1

    def tag(self) -> str:
        spread = f"a{self.adapters}" if self.adapters > 1 else ""
        return f"{self.name}:{self.K}x{self.N}r{self.r}{spread}"


def bucket_of(M: int, buckets: Sequence[int] = BUCKETS) -> int:
    """Smallest bucket holding M tokens (the largest bucket for more)."""
    for b in buckets:
        if M <= b:
            return b
    return buckets[-1]


def timed_buckets(handed_over_from: int | None, buckets: Sequence[int] = BUCKETS) -> tuple[int, ...]:
    """The buckets worth timing when batches of `handed_over_from` tokens and more never reach the dispatch
    (they take vLLM's own LoRA path, `kernels.serving_vllm_from`): up to the bucket holding one token fewer."""
    if handed_over_from is None:
        return tuple(buckets)
    top = bucket_of(max(handed_over_from - 1, 1), buckets)
    return tuple(b for b in buckets if b <= top)


def cache_key(gpu: str, vllm_version: str, shapes: Sequence[Shape], buckets: Sequence[int],
              candidates: Sequence[str]) -> str:
    text = json.dumps([CACHE_VERSION, gpu, vllm_version, [s.tag() for s in shapes], list(buckets),
                       sorted(candidates)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class DispatchTable:
    """{(shape name, bucket): {"times_us": {candidate: µs}, "best": candidate}} with lookup by token count."""

    def __init__(self, entries: dict[str, dict], buckets: Sequence[int]):
        self.entries = entries
        self.buckets = tuple(buckets)

    def best(self, shape_name: str, M: int) -> str:
        entry = self.entries.get(f"{shape_name}@{bucket_of(M, self.buckets)}")
        if entry is None:
            raise KeyError(f"dispatch table has no entry for shape {shape_name!r} (timed: "
                           f"{sorted({k.split('@')[0] for k in self.entries})})")
        return entry["best"]

    def markdown(self) -> str:
        names = sorted({c for e in self.entries.values() for c in e["times_us"]})
        lines = ["| shape | tokens | " + " | ".join(f"{n} µs" for n in names) + " | chosen |",
                 "|---|---|" + "---|" * (len(names) + 1)]
        for key, e in self.entries.items():
            shape, bucket = key.split("@")
            cells = " | ".join(f"{e['times_us'][n]:.1f}" if n in e["times_us"] else "-" for n in names)
            lines.append(f"| {shape} | {bucket} | {cells} | {e['best']} |")
        return "\n".join(lines)


def time_candidates(shapes: Sequence[Shape], buckets: Sequence[int],
                    make_candidates: Callable[[Shape, int], dict[str, Callable[[], object]]],
                    timer: Callable[[Callable[[], object]], float]) -> dict[str, dict]:
    """Time every candidate for every (shape, bucket); a candidate that raises is logged and skipped."""
    entries: dict[str, dict] = {}
    for shape in shapes:
        for M in buckets:
            times = {}
            for name, fn in make_candidates(shape, M).items():
                try:
                    times[name] = float(timer(fn))
                except Exception as exc:  # one broken candidate must not stop the engine from starting
                    log.warning("dispatch: candidate %s failed on %s at %d tokens: %s", name, shape.tag(), M, exc)
            if not times:
                raise RuntimeError(f"dispatch: every candidate failed on {shape.tag()} at {M} tokens")
            entries[f"{shape.name}@{M}"] = dict(times_us=times, best=min(times, key=times.get))
    return entries


def load_or_time(cache_dir: str | os.PathLike, gpu: str, vllm_version: str, shapes: Sequence[Shape],
                 make_candidates: Callable[[Shape, int], dict[str, Callable[[], object]]],
                 timer: Callable[[Callable[[], object]], float], candidate_names: Sequence[str],
                 buckets: Sequence[int] = BUCKETS) -> DispatchTable:
    """The cached table for this (GPU, vLLM, shapes, buckets, candidates), or time it now and cache it."""
    key = cache_key(gpu, vllm_version, shapes, buckets, candidate_names)
    path = Path(cache_dir) / f"w8a8_multi_lora_dispatch_{key}.json"
    if path.exists():
        try:
            data = json.loads(path.read_text())
            table = DispatchTable(data["entries"], data["buckets"])
            log.info("dispatch table from %s:\n%s", path, table.markdown())
            return table
        except (ValueError, KeyError) as exc:  # a torn or foreign file: re-time, do not fail the engine
            log.warning("dispatch cache %s unreadable (%s); timing again", path, exc)
    table = DispatchTable(time_candidates(shapes, buckets, make_candidates, timer), buckets)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(gpu=gpu, vllm=vllm_version, shapes=[s.tag() for s in shapes],
                                   buckets=list(buckets), entries=table.entries), indent=1))
    os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    log.info("dispatch table (timed on %s, vLLM %s), cached in %s:\n%s", gpu, vllm_version, path, table.markdown())
    return table
