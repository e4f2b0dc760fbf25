"""Memory accounting of the trainer (what a policy holds) and a pre-flight estimate (will a recipe fit?).

Base weights are counted by storage, so tied embeddings and the views of one packed FP8 buffer (q/k/v
codes share the engine's qkv storage) are counted once. Embeddings, norms and the LM head stay in the
model dtype (bf16) under every base: they are reported separately as `base_other_bytes`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig

from epirl.config import resolve_model_path
from epirl.model.lora import ALL_PROJECTIONS, is_lora_module
from epirl.model.skeleton import build_skeleton

log = logging.getLogger(__name__)
GiB = 1024 ** 3
# AdamW keeps two fp32 moments per trainable element; gradients are the parameters' dtype (fp32 masters).
ADAM_STATE_BYTES_PER_ELEMENT = 8


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _is_projection(module_name: str, module: nn.Module) -> bool:
    return module_name.rpartition(".")[2] in ALL_PROJECTIONS and not isinstance(module, nn.ModuleList)


def policy_memory_report(policy) -> dict:
    """Bytes held by the policy: base projections (and their dtype), other base tensors, LoRA, optimizer."""
    seen: set[int] = set()
    totals = {"base_projection_bytes": 0, "base_other_bytes": 0, "base_shared_bytes": 0, "lora_param_bytes": 0}
    engine_storages = getattr(policy, "engine_storages", set())
    projection_dtypes: set[str] = set()
    lora_elements = 0
    for module_name, module in policy.model.named_modules():
        projection = _is_projection(module_name, module)
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for name, t in tensors:
            if t.is_meta or _storage_key(t) in seen:
                continue
            seen.add(_storage_key(t))
            nbytes = t.untyped_storage().nbytes()
            if _storage_key(t) in engine_storages:  # mapped from the engine: no bytes of the trainer's
                totals["base_shared_bytes"] += nbytes
            elif is_lora_module(module) and name in ("lora_A", "lora_B"):
                totals["lora_param_bytes"] += nbytes
                lora_elements += t.numel() if t.requires_grad else 0
            elif projection:
                totals["base_projection_bytes"] += nbytes
                if t.ndim == 2:
                    projection_dtypes.add(str(t.dtype).removeprefix("torch."))
            else:
                totals["base_other_bytes"] += nbytes
    report = dict(totals)
    report["base_weight_bytes"] = totals["base_projection_bytes"] + totals["base_other_bytes"]
    report["base_projection_dtype"] = ",".join(sorted(projection_dtypes))
    report["lora_grad_bytes"] = totals["lora_param_bytes"]
    report["optimizer_bytes_est"] = lora_elements * ADAM_STATE_BYTES_PER_ELEMENT
    static = report["base_weight_bytes"] + 2 * totals["lora_param_bytes"] + report["optimizer_bytes_est"]
    report["static_bytes"] = static
    device = policy.device
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        report["cuda_peak_allocated_bytes"] = peak
        # Called between steps, what is allocated now is everything that persists — the trainer's static
        # bytes and, in the colocated loop, the engine's weights and KV cache in the same process. The peak
        # above it is the step's activations, logits chunks and temporaries (peak - static would count the
        # engine as activations).
        report["peak_activation_bytes_est"] = max(0, peak - torch.cuda.memory_allocated(device))
    return report


@dataclass
class TrainerEstimate:
    base_projection_bytes: int
    base_other_bytes: int
    lora_total_bytes: int  # parameters + gradients + AdamW moments
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.base_projection_bytes + self.base_other_bytes + self.lora_total_bytes + self.activation_bytes


def count_parameters(config, exclude_embeddings: bool = False) -> tuple[dict[str, tuple[int, int]], int]:
    """({projection name: (out, in)}, non-projection element count) from a meta-device skeleton.

    `exclude_embeddings`: leave the token embedding and LM head out of the count (`trainer.base: shared`
    maps them from the engine)."""
    model = build_skeleton(config, torch.bfloat16)
    projections = {n: tuple(m.weight.shape) for n, m in model.named_modules()
                   if isinstance(m, nn.Linear) and _is_projection(n, m)}
    skipped = {id(model.get_submodule(n).weight) for n in projections}
    if exclude_embeddings:
        skipped |= {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    other = sum(p.numel() for p in model.parameters() if id(p) not in skipped)
    return projections, other


def activation_bytes_per_token(config, gradient_checkpointing: bool, dtype_bytes: int = 2) -> int:
    """Saved activations per token for a LoRA backward (rough, errs high).

    Without checkpointing each layer keeps the inputs of its projections (LoRA's dA needs x), attention
    q/k/v/out, the MLP's gate/up/act, norms and residuals: ~(6H + 3q + 2kv + 4I) values. With
    checkpointing only the layer input H per layer stays, plus one layer's worth during its recompute.
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_dim = 2 * config.num_attention_heads * head_dim  # Qwen3.5 gates attention output: q_proj is 2x wide
    kv_dim = config.num_key_value_heads * head_dim
    per_layer = 6 * hidden + 3 * q_dim + 2 * kv_dim + 4 * inter
    layers = config.num_hidden_layers
    values = layers * hidden + per_layer if gradient_checkpointing else layers * per_layer
    return values * dtype_bytes


def estimate_trainer_bytes(config, base: str, rank: int, targets: list[str], micro_batch_tokens: int,
                           gradient_checkpointing: bool, logprob_chunk_tokens: int) -> TrainerEstimate:
    projections, other_elements = count_parameters(config, exclude_embeddings=base == "shared")
    projection_elements = sum(o * i for o, i in projections.values())
    bytes_per_code = {"bf16": 2, "fp8": 1, "shared": 0}[base]  # shared: the engine already holds them
    lora_elements = sum(rank * (o + i) for n, (o, i) in projections.items() if n.rpartition(".")[2] in targets)
    # fp32 param + fp32 grad + two fp32 AdamW moments
    lora_total = lora_elements * (4 + 4 + ADAM_STATE_BYTES_PER_ELEMENT)
    # One chunk of fp32 logits, its log-softmax and their gradient exist at once.
    logits_bytes = 3 * 4 * logprob_chunk_tokens * config.vocab_size
    activations = micro_batch_tokens * activation_bytes_per_token(config, gradient_checkpointing) + logits_bytes
    return TrainerEstimate(projection_elements * bytes_per_code, other_elements * 2, lora_total, activations)


class PreflightError(RuntimeError):
    """The recipe cannot fit the device; the message names the setting to change."""


def preflight_check(cfg, device_total_bytes: int, reserved_bytes: int = 0, safety: float = 0.9,
                    hf_config=None) -> TrainerEstimate:
    """Raise PreflightError (one line) if the trainer's estimate exceeds `safety` × the bytes it may use.

    `device_total_bytes - reserved_bytes` is the trainer's budget: the caller reserves what the engine
    keeps during training (weights; the KV cache is released when `engine.kv_release`). `hf_config`
    defaults to the model's config.json (local folder, alias, or hub id).
    """
    if hf_config is None:
        hf_config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.path))
    config = hf_config.get_text_config()
    tokens = cfg.trainer.micro_batch_size * (cfg.data.max_prompt_tokens + cfg.rl.max_tokens)
    estimate = estimate_trainer_bytes(config, cfg.trainer.base, cfg.lora.rank, list(cfg.lora.targets), tokens,
                                      cfg.trainer.gradient_checkpointing, cfg.trainer.logprob_chunk_tokens)
    budget = (device_total_bytes - reserved_bytes) * safety
    if estimate.total_bytes <= budget:
        return estimate
    base = estimate.base_projection_bytes + estimate.base_other_bytes
    if estimate.activation_bytes >= base and not cfg.trainer.gradient_checkpointing:
        hint = "set trainer.gradient_checkpointing=true or lower trainer.micro_batch_size"
    elif estimate.activation_bytes >= base:
        hint = f"lower trainer.micro_batch_size (now {cfg.trainer.micro_batch_size})"
    elif cfg.trainer.base == "bf16":
        hint = "use trainer.base=fp8 (or shared)"
    else:
        hint = "lower engine.gpu_memory_utilization or lora.rank, or use a larger GPU"
    raise PreflightError(
        f"trainer needs ~{estimate.total_bytes / GiB:.1f} GiB (base {base / GiB:.1f}, LoRA+AdamW "
        f"{estimate.lora_total_bytes / GiB:.2f}, activations {estimate.activation_bytes / GiB:.1f} for "
        f"{tokens} tokens/micro-batch) but only {max(budget, 0) / GiB:.1f} GiB is available: {hint}")


def preflight_beside_engine(cfg, device: torch.device) -> None:
    """Fail in seconds, not after the engine has loaded, when the trainer cannot fit beside the engine."""
    total = torch.cuda.get_device_properties(device).total_memory
    hf_config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.path))
    reserved = cfg.engine.gpu_memory_utilization * total  # the engine's whole budget, KV cache included
    if cfg.engine.kv_release:  # during training the engine keeps only its weights
        # (with trainer.base=shared the trainer's estimate counts none of them: they are counted here, once)
        engine_base = "bf16" if cfg.engine.precision == "bf16" else "fp8"
        est = estimate_trainer_bytes(hf_config.get_text_config(), engine_base, cfg.lora.rank, list(cfg.lora.targets),
                                     1, False, cfg.trainer.logprob_chunk_tokens)
        reserved = est.base_projection_bytes + est.base_other_bytes
    trainer = preflight_check(cfg, total, reserved_bytes=int(reserved), hf_config=hf_config)
    # While the engine samples, its whole budget (KV cache re-acquired) sits beside what the trainer keeps
    # between steps: its own base, LoRA, gradients and AdamW moments.
    persistent = trainer.base_projection_bytes + trainer.base_other_bytes + trainer.lora_total_bytes
    if cfg.engine.gpu_memory_utilization * total + persistent > 0.98 * total:
        raise PreflightError(
            f"engine.gpu_memory_utilization={cfg.engine.gpu_memory_utilization} leaves "
            f"{(1 - cfg.engine.gpu_memory_utilization) * total / 2**30:.1f} GiB beside the engine, but the trainer keeps "
            f"~{persistent / 2**30:.1f} GiB between steps: lower engine.gpu_memory_utilization or use trainer.base=shared")


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token takes in the full-attention layers (Qwen3.5's linear-attention layers keep a
    fixed state per sequence instead)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    full_layers = sum(1 for t in layer_types if t == "full_attention")
    return 2 * full_layers * config.num_key_value_heads * head_dim * dtype_bytes


def memory_plan(cfg, device: torch.device) -> dict[str, float]:
    """The recipe's expected memory, before the engine starts (bytes; `plan/...` keys).

    Engine weights: FP8 projections + 16-bit embeddings/norms (bf16 engine: all 16-bit), text model only.
    KV pool: what vLLM's budget leaves after the weights (an upper bound: vLLM also keeps activations and
    CUDA-graph buffers inside it). Trainer: its own base bytes (0 projections under `trainer.base: shared`),
    LoRA parameters + gradients + AdamW moments, and the activation peak of one micro-batch of
    `data.max_prompt_tokens + rl.max_tokens` tokens."""
    config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.path)).get_text_config()
    engine_base = "bf16" if cfg.engine.precision == "bf16" else "fp8"
    engine = estimate_trainer_bytes(config, engine_base, cfg.lora.rank, list(cfg.lora.targets), 1, False, 1)
    tokens = cfg.trainer.micro_batch_size * min(cfg.data.max_prompt_tokens + cfg.rl.max_tokens, cfg.model.max_model_len)
    trainer = estimate_trainer_bytes(config, cfg.trainer.base, cfg.lora.rank, list(cfg.lora.targets), tokens,
                                     cfg.trainer.gradient_checkpointing, cfg.trainer.logprob_chunk_tokens)
    engine_weights = engine.base_projection_bytes + engine.base_other_bytes
    # The estimates count 16-bit values; a float32 trainer (the CPU default) holds twice as many bytes.
    widen = 2.0 if cfg.model.dtype == "float32" else 1.0
    trainer_base = (trainer.base_projection_bytes * (widen if cfg.trainer.base == "bf16" else 1.0)
                    + trainer.base_other_bytes * widen)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        kv_pool = max(0.0, cfg.engine.gpu_memory_utilization * total - engine_weights)
    else:
        total, kv_pool = 0, cfg.engine.cpu_kv_cache_gb * GiB
    per_token = kv_bytes_per_token(config)
    return {"plan/device_total_bytes": float(total), "plan/engine_weight_bytes": float(engine_weights),
            "plan/kv_pool_bytes": float(kv_pool), "plan/kv_tokens": float(kv_pool // per_token) if per_token else 0.0,
            "plan/trainer_base_bytes": float(trainer_base),
            "plan/trainer_lora_optimizer_bytes": float(trainer.lora_total_bytes),
            "plan/trainer_activation_bytes": float(trainer.activation_bytes * widen),
            "plan/micro_batch_tokens": float(tokens)}


def log_memory_plan(plan: dict[str, float]) -> None:
    g = {k.removeprefix("plan/"): v / GiB for k, v in plan.items() if k.endswith("_bytes")}
    log.info(
        "memory plan: engine weights %.2f GiB + KV pool %.2f GiB (~%d tokens) | trainer base %.2f GiB, LoRA+AdamW "
        "%.2f GiB, activations %.2f GiB (%d tokens/micro-batch) | device %.1f GiB", g["engine_weight_bytes"],
        g["kv_pool_bytes"], plan["plan/kv_tokens"], g["trainer_base_bytes"], g["trainer_lora_optimizer_bytes"],
        g["trainer_activation_bytes"], plan["plan/micro_batch_tokens"], g["device_total_bytes"])
