"""LoRA adapters in PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`.

That is what `peft.PeftModel.from_pretrained` and vLLM's `LoRARequest` read as is. Tensor names are
`base_model.model.<module path>.lora_{A,B}.weight` (PEFT drops the adapter name "default" when saving;
the module path as the checkpoint spells it: `model.language_model.layers...` for Qwen3.5's VL checkpoints),
A is [r, in], B is [out, r], unscaled: readers apply lora_alpha / r.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from epirl.model.dummy import mark_random_weights
from epirl.model.policy import Policy
from epirl.model.weights import NESTED_TEXT_PREFIX

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_adapter_config(rank: int, alpha: float, targets: list[str], base_model: str | None = None) -> dict:
    """The adapter_config.json fields of a PEFT `LoraConfig` (peft ≥ 0.10 and vLLM's PEFTHelper read these)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


class AdapterConfigError(ValueError):
    """An adapter folder that is missing or whose adapter_config.json lacks what epirl reads (one line)."""


class AdapterSettings(NamedTuple):
    rank: int
    alpha: float
    targets: list[str]  # module names (last component), sorted; empty when the config lists none


def read_adapter_settings(folder: str | os.PathLike) -> AdapterSettings:
    """r, lora_alpha and target_modules of a PEFT adapter folder's adapter_config.json (lora_alpha defaults to
    8, `peft.LoraConfig`'s default). Raises AdapterConfigError naming the folder or file."""
    folder = Path(folder)
    config_file = folder / ADAPTER_CONFIG
    if not folder.is_dir():
        raise AdapterConfigError(f"folder not found: {folder}")
    if not config_file.is_file():
        raise AdapterConfigError(f"{folder} has no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    try:
        config = json.loads(config_file.read_text())
        rank = int(config["r"])
    except (ValueError, KeyError, TypeError):
        raise AdapterConfigError(f"{config_file} has no integer 'r' (LoRA rank)") from None
    try:
        alpha = float(config.get("lora_alpha", 8))
    except (ValueError, TypeError):
        raise AdapterConfigError(f"{config_file}: 'lora_alpha' is not a number") from None
    targets = config.get("target_modules") or []
    targets = [t.rsplit(".", 1)[-1] for t in ([targets] if isinstance(targets, str) else targets)]
    return AdapterSettings(rank, alpha, sorted(set(targets)))


TRAINER_STEM = "base_model.model.model."
NESTED_STEM = "base_model.model." + NESTED_TEXT_PREFIX  # base_model.model.model.language_model.


def checkpoint_key(key: str, nested: bool) -> str:
    """The trainer's PEFT key as the checkpoint spells the module: a vision-language checkpoint (Qwen3.5)
    nests the text model under `model.language_model.`, and vLLM only maps adapter names spelled that way."""
    if nested and key.startswith(TRAINER_STEM) and not key.startswith(NESTED_STEM):
        return NESTED_STEM + key[len(TRAINER_STEM):]
    return key


def trainer_key(key: str) -> str:
    return TRAINER_STEM + key[len(NESTED_STEM):] if key.startswith(NESTED_STEM) else key


def save_adapter(policy: Policy, out_dir: str | os.PathLike, cfg=None) -> Path:
    """Write the adapter atomically enough for a reader: files are written then renamed into place.

    `cfg` is accepted for the interface's sake (rank/alpha/targets are taken from the policy itself,
    which is what the tensors were trained with).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # safetensors wants contiguous CPU tensors; bf16 is what vLLM and PEFT use for adapters of bf16 models,
    # but the fp32 masters are kept exactly here (readers cast on load).
    tensors = {checkpoint_key(k, policy.nests_text_model): v.detach().to("cpu").contiguous()
               for k, v in policy.lora_state_dict().items()}
    tmp_weights, tmp_config = out_dir / f".{ADAPTER_WEIGHTS}.tmp", out_dir / f".{ADAPTER_CONFIG}.tmp"
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    # Only projections that exist in this model (a recipe may list Qwen3.5-only names for a Llama).
    targets = sorted({name.rpartition(".")[2] for name in policy.lora_modules()})
    config = peft_adapter_config(policy.lora_rank, policy.lora_alpha, targets, base_model=policy.model_path)
    tmp_config.write_text(json.dumps(config, indent=2))
    os.replace(tmp_weights, out_dir / ADAPTER_WEIGHTS)
    os.replace(tmp_config, out_dir / ADAPTER_CONFIG)
    if getattr(policy, "random_weights", False):  # eval and resume refuse it (epirl.model.dummy)
        mark_random_weights(out_dir)
    return out_dir


def load_adapter(policy: Policy, in_dir: str | os.PathLike) -> None:
    """Load a PEFT adapter written by `save_adapter` (or by PEFT for the same targets and rank)."""
    in_dir = Path(in_dir)
    config = json.loads((in_dir / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{in_dir}: not a LoRA adapter (peft_type={config.get('peft_type')!r})")
    if config["r"] != policy.lora_rank or float(config["lora_alpha"]) != float(policy.lora_alpha):
        raise ValueError(f"{in_dir}: adapter r={config['r']}, alpha={config['lora_alpha']} but the policy has "
                         f"lora.rank={policy.lora_rank}, lora.alpha={policy.lora_alpha}")
    state = load_file(str(in_dir / ADAPTER_WEIGHTS), device="cpu")
    # PEFT checkpoints saved with an explicit adapter name carry it in the key; drop it.
    state = {k.replace(".lora_A.default.weight", ".lora_A.weight").replace(".lora_B.default.weight", ".lora_B.weight"): v
             for k, v in state.items()}
    state = {trainer_key(k): v for k, v in state.items()}  # either spelling of a nested text model
    policy.load_lora_state_dict({k: v.to(torch.float32) for k, v in state.items()})
