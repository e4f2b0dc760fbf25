"""Engine construction facts: process environment, `EngineArgs` fields, the FP8 method name, LoRA rank slots.

Read from vLLM 0.26 and 0.32 source: `vllm/envs.py` (VLLM_ENABLE_V1_MULTIPROCESSING, VLLM_CPU_KVCACHE_SPACE,
read lazily at engine construction), `vllm/engine/arg_utils.py` (`EngineArgs` dataclass fields),
`vllm/config/vllm.py` (`get_current_vllm_config_or_none()`: the `VllmConfig` being built, set while vLLM builds
the model; its `additional_config` dict enters the config hash that keys the torch.compile cache),
`vllm/model_executor/layers/quantization/__init__.py` (`QUANTIZATION_METHODS`: `fp8_per_tensor` is listed in
0.26 and 0.32; older releases only had `fp8`), `vllm/config/lora.py` (`MaxLoRARanks`, unchanged 0.26–0.33).

Public API that would replace it: the environment variables and `EngineArgs` are public; the list of
quantization names and of allowed `max_lora_rank` values has no public accessor (a vLLM that validated
`max_lora_rank` against any power of two would make `lora_rank_slot` unnecessary).
"""

from __future__ import annotations

import os

from epirl.engine.vllm_compat.detect import absent

# vLLM's allowed `max_lora_rank` values (LoRAConfig.MaxLoRARanks, unchanged 0.26–0.33).
_LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


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
    """Name of vLLM's online per-tensor FP8 method: `fp8_per_tensor` where listed, else `fp8`."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return "fp8_per_tensor" if "fp8_per_tensor" in QUANTIZATION_METHODS else "fp8"


def llm_kwargs_supported(names: list[str]) -> dict[str, bool]:
    """Which of `names` are fields of vLLM's EngineArgs in this version."""
    from vllm.engine.arg_utils import EngineArgs

    fields = getattr(EngineArgs, "__dataclass_fields__", {})
    return {n: n in fields for n in names}


def validate_engine_config(llm_kwargs: dict) -> None:
    """vLLM's own validation of `vllm.LLM` arguments (EngineArgs -> VllmConfig) without loading weights; raises what
    vLLM raises. Public replacement: none that stops before the model loads (`vllm.LLM` validates and loads)."""
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs(**llm_kwargs).create_engine_config()


def current_additional_config() -> dict | None:
    """`additional_config` of the vLLM config in effect (while vLLM builds a model), else None."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return None if config is None else getattr(config, "additional_config", None)


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    return absent(["vllm.config:get_current_vllm_config_or_none", "vllm.config:VllmConfig.additional_config",
                   "vllm.engine.arg_utils:EngineArgs.__dataclass_fields__",
                   "vllm.engine.arg_utils:EngineArgs.create_engine_config",
                   "vllm.model_executor.layers.quantization:QUANTIZATION_METHODS"])
