"""In-memory adapters: the worker's `_load_adapter` wrapped, `LoRAModel.from_lora_tensors`, `PEFTHelper`.

Read from vLLM 0.26 and 0.32 source: `vllm/lora/worker_manager.py` (`WorkerLoRAManager._load_adapter(request)
-> LoRAModel` is the one place where a `LoRARequest` turns into weights; it reads `self._adapter_manager.model`,
`lora_config`, `vocab_size`, `max_position_embeddings`), `vllm/lora/lora_model.py` (`LoRAModel.
from_lora_tensors(lora_model_id, tensors, peft_helper, device, dtype, model_vocab_size, weights_mapper,
skip_prefixes)`, the same keywords in 0.26 and 0.32; earlier releases took others, hence the signature
filter), `vllm/lora/peft_helper.py` (`PEFTHelper.from_dict`, `validate_legal`),
`vllm/model_executor/models/utils.py` (`WeightsMapper.get_unstacked_mapper` in 0.26,
`get_rename_mapper` in 0.32).

Public API that would replace it: none in 0.26–0.33 loads an adapter from tensors held in memory; the public
path is a PEFT folder on disk (`LoRARequest(lora_path=...)`, what `RolloutEngine.load_adapter_dir` uses),
which costs a safetensors write and read per optimizer step.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from epirl.engine.vllm_compat.detect import absent
from epirl.engine.vllm_compat.model_access import lora_manager


def install_adapter_loader(llm, load_in_memory: Callable[[Any, Any], Any | None]) -> None:
    """Route the worker's adapter loading through `load_in_memory(manager, request)` first.

    Everything after `_load_adapter` (packing q/k/v, slot copy, activation) is shared. We wrap it on the
    instance: when `load_in_memory` returns a LoRAModel (an epirl in-memory adapter), that is used;
    otherwise the original file loader runs (PEFT dirs still work).
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


def peft_helper(adapter_config: dict[str, Any]) -> Any:
    """vLLM's `PEFTHelper` for an adapter_config.json dict."""
    from vllm.lora.peft_helper import PEFTHelper

    return PEFTHelper.from_dict(adapter_config)


def lora_model_from_tensors(mgr, lora_id: int, tensors: dict[str, torch.Tensor], helper: Any, device: str) -> Any:
    """A `LoRAModel` built from tensors in memory, as `_load_adapter` would build it from a folder.

    `tensors` are handed over as they are: vLLM scales B in place (`lora_b *= alpha/r`), so pass clones."""
    from vllm.lora.lora_model import LoRAModel

    ctx = lora_load_context(mgr)
    helper.validate_legal(ctx["lora_config"])
    kwargs = {key: ctx[key] for key in ("dtype", "model_vocab_size", "weights_mapper", "skip_prefixes")}
    accepted = inspect.signature(LoRAModel.from_lora_tensors).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return LoRAModel.from_lora_tensors(lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device=device,
                                       **kwargs)


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    lacking = absent(["vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
                      "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager",
                      "vllm.lora.lora_model:LoRAModel.from_lora_tensors",
                      "vllm.lora.peft_helper:PEFTHelper.from_dict",
                      "vllm.lora.peft_helper:PEFTHelper.validate_legal"])
    mappers = ["vllm.model_executor.models.utils:WeightsMapper.get_unstacked_mapper",
               "vllm.model_executor.models.utils:WeightsMapper.get_rename_mapper"]
    if len(absent(mappers)) == len(mappers):
        lacking.append(" or ".join(mappers))
    return lacking
