"""Reaching the worker, its model runner, the model and the worker's LoRA manager of an in-process `LLM`.

Read from vLLM 0.26 and 0.32 source: `vllm/v1/engine/llm_engine.py` (`LLMEngine.model_executor` when the
engine core runs in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0), `vllm/v1/executor/uniproc_executor.py`
(`driver_worker`, a `WorkerWrapperBase` whose `.worker` is the `Worker`), `vllm/v1/worker/gpu_worker.py` /
`cpu_worker.py` (`.model_runner`), `vllm/v1/worker/gpu_model_runner.py` (`get_model()`, `lora_manager` from
`LoRAModelRunnerMixin`, `kv_caches`, `sampler`); torch.compile wraps the model as `_orig_mod`.

Public API that would replace it: `LLM.apply_model(fn)` / `LLM.collective_rpc` run a function on the model
inside each worker (both exist in 0.26 and 0.32), but they return results, not live handles: the shared FP8
base needs zero-copy views that stay valid for the whole run, and the adapter loader must wrap a method of
the worker's LoRA manager, so epirl keeps the live objects of the in-process engine.
"""

from __future__ import annotations

from typing import Any

import torch

from epirl.engine.vllm_compat.detect import absent


def _executor(llm) -> Any:
    engine = llm.llm_engine
    if hasattr(engine, "model_executor"):
        return engine.model_executor
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    if core is not None and hasattr(core, "model_executor"):
        return core.model_executor
    raise RuntimeError("cannot reach vLLM's model executor: is VLLM_ENABLE_V1_MULTIPROCESSING=0 set?")


def worker(llm) -> Any:
    driver = _executor(llm).driver_worker
    return getattr(driver, "worker", driver)


def model_runner(llm) -> Any:
    return worker(llm).model_runner


def model(llm) -> torch.nn.Module:
    """The model vLLM runs (LoRA wraps layers in place; compile wrappers unwrapped)."""
    runner = model_runner(llm)
    m = runner.get_model() if hasattr(runner, "get_model") else runner.model
    return getattr(m, "_orig_mod", m)


def lora_manager(llm) -> Any:
    """The worker-side LoRA manager (`LRUCacheWorkerLoRAManager` in 0.26–0.33)."""
    runner = model_runner(llm)
    mgr = getattr(runner, "lora_manager", None)
    if mgr is None:
        raise RuntimeError("vLLM was started without enable_lora=True: no worker LoRA manager")
    return mgr


def kv_cache_tensors(llm) -> list[torch.Tensor]:
    """The model runner's KV-cache tensors (empty before the cache is allocated)."""
    return [t for t in getattr(model_runner(llm), "kv_caches", []) if isinstance(t, torch.Tensor)]


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks (the live chain itself is checked by the
    engine tests: it only exists once an `LLM` runs)."""
    return absent(["vllm.v1.engine.llm_engine:LLMEngine", "vllm.v1.executor.uniproc_executor:UniProcExecutor",
                   "vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin"])
