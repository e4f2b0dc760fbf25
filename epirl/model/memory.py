"""Memory accounting of the trainer (what a policy holds) and a pre-flight estimate (will a recipe fit?).

Base weights are counted by storage, so tied embeddings and the views of one packed FP8 buffer (q/k/v
codes share the engine's qkv storage) are counted once. Embeddings, norms and the LM head stay in the
model dtype (bf16) under every base: they are reported separately as `base_other_bytes`.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig

from epirl.config import resolve_model_path
from epirl.model.logprobs import chunked_token_logprobs
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
    activations: "ActivationEstimate | None" = None  # the activation estimate's terms

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


# ---- Activation peak of one trainer micro-batch (forward + backward) -------------------------------------------
#
# What is alive at the peak, from the code (epirl/rl/trainer.py optimizer_step, epirl/model/logprobs.py, transformers'
# decoder layers, kernels/lora_linear), for N = micro_batch_size x sequence tokens:
#   layer_inputs   gradient checkpointing (non-reentrant, per decoder layer) keeps each layer's input, L·N·H in
#                  the model dtype; without it every layer's saved tensors (layer_saved below) stay instead.
#   entropy_graph  only while the entropy metric carries an autograd graph (policy.py before 6f1e04d; probed by
#                  entropy_keeps_graph): its exp/mul nodes stay referenced (entropy_B_T lives until the next
#                  micro-batch's forward), so when the LM-head chunks are recomputed in backward their fp32
#                  log-softmax and its exp are kept for every chunk: 2·N·V·4 bytes (17 GiB at 4×2304 tokens and
#                  Qwen3.5's 248k vocabulary). The H200 measurements below were taken with it; the trainer no longer keeps it (0).
#   head           the final norm's fp32 input, its output (the chunks' input), that output's gradient and the
#                  residual gradients: H·4 + 3·H·a, plus the per-token fp32 loss tensors.
#   then the larger of
#   top_layer      one decoder layer recomputed with its saved tensors (layer_saved) plus its backward
#                  temporaries (layer_transient): the gated-DeltaNet layer on the torch fallback is 2x an attention
#                  layer (fp32 copies of q/k/v, the chunked UT-transform matrices, the per-chunk state history);
#   logits_chunk   one LM-head chunk in flight: fp32 logits, log-softmax, exp and exp·log p (4·C·V·4) (with the
#                  entropy graph, while the previous micro-batch's 2·N·V·4 is still referenced).
#   margin         5 % for what the CPU checks cannot see: cuBLAS / SDPA workspaces, Triton temporaries.
# The measured peak is torch's max_memory_allocated above what stays allocated, so allocator fragmentation (the
# reserved-but-free blocks) is not in it and not in this estimate; preflight_check's safety factor covers it.
#
# Checked against (see tests/test_memory_estimate.py):
# - H200, Qwen3.5-9B shapes, 4×2304 tokens, rank 64 on 12 projections, shared FP8 base, torch GDN
#   fallback, checkpointing, chunk 1024, entropy with grad (the torch-fallback run of `gpu_main_recipe.sh q35`):
#   measured 24.09 GiB (step 2; step 1's 22.79 is the same peak minus the AdamW moments created after it). Estimate with
#   entropy_graph=True 25.9 GiB: layer_inputs 2.25 + entropy_graph 17.05 + top_layer (GDN torch) 4.99 + head 0.35
#   + margin 1.23. Without the graph (the current code) 8.0 GiB; the measurement implies ~7.05 (not measured yet).
# - H200, Qwen3-8B shapes, same settings on 7 projections, shared W8A16 engine and bf16 trainer base:
#   entropy with grad: measured 15.71 GiB (steps 2-3; step 1 14.41). Estimate 16.49 / 16.50 GiB (1.05x):
#   layer_inputs 2.53 + entropy_graph 10.43 + top_layer 2.39 + head 0.35 + margin 0.79 (the current code: 5.5 GiB).
# - CPU, one real-width decoder layer (H 4096, I 12288, bf16, LoRA rank 64), per-token slope of the forward+backward
#   peak over T = 128..512 (torch.profiler allocation events): GDN torch fallback 578 KiB, Qwen3.5 full attention
#   297 KiB, Qwen3-8B layer 274 KiB, each including the embedding output, final norm and an fp32 copy of the output
#   (~48 KiB); their saved tensors (saved_tensors_hooks, by storage) 488 / 210 / 186 KiB against layer_saved's
#   488 / 210 / 193 KiB. The kernels' CPU FP8 reference backward computes in float64 (its dX products and one
#   weight as float64: cpu_reference_fp8 below); the Triton backward keeps only bf16 dX and [N, r] products.
# - CPU, the real optimizer_step (2 micro-batches, second step: peak - end, as the GPU run measures), estimate /
#   measured, entropy without grad: SmolLM2-135M shapes fp32 no checkpointing 16x96 tokens 1.10 (2792 / 2548 MiB,
#   peak in an LM-head chunk); Qwen3.5 widths, 4 layers, vocab 32k, 2x256 tokens, checkpointing 1.12, without
#   1.02; Qwen3-8B widths 1.11; small models in tests/test_memory_estimate.py 1.05-1.17. With the entropy graph
#   (before 6f1e04d): 1.09 / 1.09 / 1.02 / 1.07, FP8 base on the CPU reference 1.21-1.25.
# Not checked: flash-linear-attention's kernels (no working fla on the machines we measure on): their term counts
# bf16 q/k/v (+ l2-normed q/k), the fp32 A matrix, and a backward that recomputes w/u/h and holds dh and five
# bf16 gradients at once — an estimate from fla 0.6's chunk_gated_delta_rule_bwd, not a measurement.

ESTIMATE_MARGIN = 0.05
GDN_CHUNK = 64  # transformers' torch_chunk_gated_delta_rule and fla's chunk size


def _attention_saved(config, a: int) -> int:
    """Per-token bytes a full-attention block saves: q, k, v, output and o_proj's input (SDPA flash/efficient:
    + fp32 log-sum-exp); Qwen3/3.5 add fp32 copies in q/k RMSNorm; Qwen3.5 gates the output (2 more tensors)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    saved = 3 * q * a + 2 * kv * a + heads * 4
    if "qwen3" in config.model_type:  # q_norm / k_norm
        saved += (q + kv) * 4
    if config.model_type.startswith(("qwen3_5", "qwen3_next")):  # attention output gate
        saved += 2 * q * a
    return saved


def _gdn_dims(config) -> tuple[int, int, int, int]:
    v_heads = config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    conv_dim = 2 * config.linear_num_key_heads * dk + v_heads * dv
    return v_heads, dk, dv, conv_dim


def _gdn_saved(config, a: int, kernel: str) -> int:
    """Per-token bytes a gated-DeltaNet block saves. Both kernels: conv1d input and output, z, the gated
    RMSNorm's fp32 input / gate / product and out_proj's input. Torch fallback (transformers
    torch_chunk_gated_delta_rule, fp32 throughout, q/k repeated to the value heads): 11 [Hv·d] fp32 tensors
    (q, k before and after l2norm/padding, v, k·β, decayed q/k, k_cumdecay, new values, per-chunk v_new), five
    [Hv·64] chunk matrices and the recurrent state saved once per 64-token chunk. fla: bf16 q/k/v, l2-normed q/k,
    fp32 A."""
    v_heads, dk, dv, conv_dim = _gdn_dims(config)
    wide = v_heads * max(dk, dv)
    common = 2 * conv_dim * a + 2 * v_heads * dv * a + 3 * v_heads * dv * 4
    if kernel == "fla":
        return common + 5 * wide * a + v_heads * GDN_CHUNK * 4
    state = v_heads * dk * dv * 4 // GDN_CHUNK
    return common + 11 * wide * 4 + 5 * v_heads * GDN_CHUNK * 4 + state


def _gdn_transient(config, a: int, kernel: str) -> int:
    v_heads, dk, dv, _ = _gdn_dims(config)
    wide = v_heads * max(dk, dv)
    if kernel == "fla":  # recomputed w, u, v_new, h; dh; dq, dk, dv, dw, du
        return 8 * wide * a + 2 * v_heads * dk * dv * a // GDN_CHUNK + v_heads * GDN_CHUNK * 4
    return 4 * wide * 4  # gradients of the fp32 chunk tensors


def layer_saved_bytes(config, layer_type: str, a: int, gdn_kernel: str, lora_rank: int = 0,
                      lora_targets: int = 0) -> int:
    """Per-token bytes one decoder layer keeps for its backward: two RMSNorms (fp32 input + normed output),
    the MLP (gate, up, silu(gate), their product = down_proj's input), the mixer, and x·Aᵀ of each bf16 LoRA."""
    hidden, inter = config.hidden_size, config.intermediate_size
    mixer = _gdn_saved(config, a, gdn_kernel) if layer_type == "linear_attention" else _attention_saved(config, a)
    return 2 * hidden * (4 + a) + 4 * inter * a + mixer + lora_targets * lora_rank * a


def layer_transient_bytes(config, layer_type: str, a: int, gdn_kernel: str, cpu_reference_fp8: bool = False) -> int:
    """Per-token backward temporaries of one layer on top of its saved tensors: the MLP's two intermediate-width
    gradients, residual gradients and an fp32 norm gradient (measured 55-58 KiB at 8B widths against 80 here);
    the GDN torch fallback's fp32 gradients; the CPU FP8 reference backward's float64 operands and products."""
    hidden, inter = config.hidden_size, config.intermediate_size
    transient = 2 * inter * a + 2 * hidden * a + hidden * 4
    if layer_type == "linear_attention":
        transient = max(transient, _gdn_transient(config, a, gdn_kernel))
    if cpu_reference_fp8:  # float64 copies of g and of the fp32 dX products (kernels' reference backward)
        transient += 3 * max(inter, hidden) * 8
    return transient


def _largest_projection_elements(config) -> int:
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    q = 2 * heads * (getattr(config, "head_dim", None) or hidden // heads)  # Qwen3.5's gated q_proj: 2x wide
    gdn = _gdn_dims(config)[3] if "linear_attention" in layer_types(config) else 0
    return hidden * max(inter, q, gdn)


def layer_types(config) -> list[str]:
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


@dataclass
class ActivationEstimate:
    terms: dict[str, int]  # named bytes; their sum is the estimate
    peak: str  # the phase the peak is in
    gdn_kernel: str  # "none", "fla" or "torch" (what the GDN layers were assumed to run)

    @property
    def total_bytes(self) -> int:
        return sum(self.terms.values())


def entropy_keeps_graph() -> bool:
    """Whether the trainer's entropy metric (Policy.token_logprobs(with_entropy=True)) carries an autograd graph,
    which keeps every LM-head chunk's fp32 log-softmax and exp alive through backward: probed on a toy head."""
    head = nn.Linear(2, 3, bias=False).requires_grad_(False)
    hidden = torch.zeros(2, 2, requires_grad=True)
    with torch.enable_grad():
        _, entropy = chunked_token_logprobs(hidden, torch.zeros(2, dtype=torch.long), head, 1.0, 2, with_entropy=True)
    return entropy is not None and entropy.requires_grad


def activation_estimate(config, tokens: int, gradient_checkpointing: bool, chunk_tokens: int, dtype_bytes: int = 2,
                        gdn_kernel: str = "torch", lora_rank: int = 0, lora_targets: int = 0,
                        cpu_reference_fp8: bool = False, entropy_graph: bool | None = None) -> ActivationEstimate:
    """Upper bound of the trainer's activation peak for one micro-batch of `tokens` tokens (terms: see above).
    `entropy_graph`: None = as the trainer's code does it (entropy_keeps_graph)."""
    if entropy_graph is None:
        entropy_graph = entropy_keeps_graph()
    a, hidden, vocab = dtype_bytes, config.hidden_size, config.vocab_size
    kinds = layer_types(config)
    gdn_kernel = gdn_kernel if "linear_attention" in kinds else "none"
    saved = {k: layer_saved_bytes(config, k, a, gdn_kernel, lora_rank, lora_targets) for k in set(kinds)}
    transient = {k: layer_transient_bytes(config, k, a, gdn_kernel, cpu_reference_fp8) for k in set(kinds)}
    terms: dict[str, int] = {}
    if gradient_checkpointing:
        terms["layer_inputs"] = len(kinds) * tokens * hidden * a
        top = max(set(kinds), key=lambda k: saved[k] + transient[k])
        top_layer = tokens * (saved[top] + transient[top])
    else:
        terms["layer_saved"] = tokens * sum(saved[k] for k in kinds)
        top = max(set(kinds), key=lambda k: transient[k])
        top_layer = tokens * transient[top]
    if entropy_graph:
        terms["entropy_graph"] = 2 * tokens * vocab * 4
    terms["head"] = tokens * (hidden * 4 + 3 * hidden * a + 16 * 4)
    logits_chunk = 4 * min(chunk_tokens, tokens) * vocab * 4
    if top_layer >= logits_chunk:
        terms["top_layer"], peak = top_layer, f"backward of a {top} layer"
    else:
        terms["logits_chunk"], peak = logits_chunk, "an LM-head chunk"
    if cpu_reference_fp8:  # the CPU reference GEMM reads the FP8 codes as float64: one weight, 8 bytes/element
        terms["cpu_fp8_reference_weight"] = 8 * _largest_projection_elements(config)
    terms["margin"] = int(ESTIMATE_MARGIN * sum(terms.values()))
    return ActivationEstimate(terms, peak, gdn_kernel)


def activation_bytes_per_token(config, gradient_checkpointing: bool, dtype_bytes: int = 2) -> int:
    """Decoder activations per token (no vocabulary terms): layer inputs (or every layer's saved tensors)
    plus one layer's recompute and backward; the GDN torch fallback assumed."""
    estimate = activation_estimate(config, 1, gradient_checkpointing, 0, dtype_bytes, entropy_graph=False)
    terms = estimate.terms
    return terms.get("layer_inputs", 0) + terms.get("layer_saved", 0) + terms.get("top_layer", 0)


def assumed_gdn_kernel(config, device: torch.device) -> str:
    """What the plan assumes Qwen3.5's GDN layers run: fla when it imports on CUDA, else the torch fallback.

    (fla can import and still fail its start-up check, epirl.model.linear_attention; then the trainer runs the
    torch fallback and this plan is low: the benchmark output names the kernel that ran.)"""
    if "linear_attention" not in layer_types(config):
        return "none"
    if device.type == "cuda" and importlib.util.find_spec("fla") is not None:
        return "fla"
    return "torch"


def estimate_trainer_bytes(config, base: str, rank: int, targets: list[str], micro_batch_tokens: int,
                           gradient_checkpointing: bool, logprob_chunk_tokens: int, dtype_bytes: int = 2,
                           gdn_kernel: str = "torch", device_type: str = "cuda",
                           entropy_graph: bool | None = None) -> TrainerEstimate:
    projections, other_elements = count_parameters(config, exclude_embeddings=base == "shared")
    projection_elements = sum(o * i for o, i in projections.values())
    bytes_per_code = {"bf16": 2, "fp8": 1, "shared": 0}[base]  # shared: the engine already holds them
    lora_elements = sum(rank * (o + i) for n, (o, i) in projections.items() if n.rpartition(".")[2] in targets)
    # fp32 param + fp32 grad + two fp32 AdamW moments
    lora_total = lora_elements * (4 + 4 + ADAM_STATE_BYTES_PER_ELEMENT)
    targets_per_layer = len({n.rpartition(".")[2] for n in projections} & set(targets))
    activations = activation_estimate(
        config, micro_batch_tokens, gradient_checkpointing, logprob_chunk_tokens, dtype_bytes, gdn_kernel,
        lora_rank=rank if base == "bf16" else 0, lora_targets=targets_per_layer,
        cpu_reference_fp8=device_type == "cpu" and base != "bf16", entropy_graph=entropy_graph)
    # Base bytes are counted 16-bit (memory_plan widens them for a float32 trainer); activations in `dtype_bytes`.
    return TrainerEstimate(projection_elements * bytes_per_code, other_elements * 2, lora_total,
                           activations.total_bytes, activations)



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
                                      cfg.trainer.gradient_checkpointing, cfg.trainer.logprob_chunk_tokens,
                                      dtype_bytes_of(cfg))
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
    full_layers = sum(1 for t in layer_types(config) if t == "full_attention")
    return 2 * full_layers * config.num_key_value_heads * head_dim * dtype_bytes


GDN_KERNEL_CODES = {"none": 0.0, "torch": 1.0, "fla": 2.0}  # `plan/gdn_kernel` (the plan's values are floats)


def dtype_bytes_of(cfg) -> int:
    return 4 if cfg.model.dtype == "float32" else 2


def memory_plan(cfg, device: torch.device, prompt_tokens: int | None = None) -> dict[str, float]:
    """The recipe's expected memory, before the engine starts (bytes; `plan/...` keys).

    Engine weights: FP8 projections + 16-bit embeddings/norms (bf16 engine: all 16-bit), text model only.
    KV pool: what vLLM's budget leaves after the weights (an upper bound: vLLM also keeps activations and
    CUDA-graph buffers inside it). Trainer: its own base bytes (0 projections under `trainer.base: shared`),
    LoRA parameters + gradients + AdamW moments, and the activation peak of one micro-batch of
    `data.max_prompt_tokens + rl.max_tokens` tokens (`prompt_tokens` replaces the prompt cap, e.g. a benchmark's
    synthetic prompt length), term by term under `plan/activation/<term>_bytes` (activation_estimate)."""
    config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.path)).get_text_config()
    engine_base = "bf16" if cfg.engine.precision == "bf16" else "fp8"
    engine = estimate_trainer_bytes(config, engine_base, cfg.lora.rank, list(cfg.lora.targets), 1, False, 1)
    prompt = cfg.data.max_prompt_tokens if prompt_tokens is None else prompt_tokens
    tokens = cfg.trainer.micro_batch_size * min(prompt + cfg.rl.max_tokens, cfg.model.max_model_len)
    gdn_kernel = assumed_gdn_kernel(config, device)
    trainer = estimate_trainer_bytes(config, cfg.trainer.base, cfg.lora.rank, list(cfg.lora.targets), tokens,
                                     cfg.trainer.gradient_checkpointing, cfg.trainer.logprob_chunk_tokens,
                                     dtype_bytes_of(cfg), gdn_kernel, device.type)
    engine_weights = engine.base_projection_bytes + engine.base_other_bytes
    # The base estimates count 16-bit values; a float32 trainer (the CPU default) holds twice as many bytes
    # (the activation estimate already counts the model dtype).
    widen = 2.0 if cfg.model.dtype == "float32" else 1.0
    trainer_base = (trainer.base_projection_bytes * (widen if cfg.trainer.base == "bf16" else 1.0)
                    + trainer.base_other_bytes * widen)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        kv_pool = max(0.0, cfg.engine.gpu_memory_utilization * total - engine_weights)
    else:
        total, kv_pool = 0, cfg.engine.cpu_kv_cache_gb * GiB
    per_token = kv_bytes_per_token(config)
    terms = {f"plan/activation/{name}_bytes": float(value) for name, value in trainer.activations.terms.items()}
    return {"plan/device_total_bytes": float(total), "plan/engine_weight_bytes": float(engine_weights),
            "plan/kv_pool_bytes": float(kv_pool), "plan/kv_tokens": float(kv_pool // per_token) if per_token else 0.0,
            "plan/trainer_base_bytes": float(trainer_base),
            "plan/trainer_lora_optimizer_bytes": float(trainer.lora_total_bytes),
            "plan/trainer_activation_bytes": float(trainer.activation_bytes),
            "plan/micro_batch_tokens": float(tokens),
            "plan/gdn_kernel": GDN_KERNEL_CODES[trainer.activations.gdn_kernel], **terms}


def activation_terms_line(plan: dict[str, float]) -> str:
    """'layer_inputs 2.25 + entropy_graph 17.05 + ... GiB (GDN layers: torch fallback assumed)'."""
    prefix = "plan/activation/"
    terms = " + ".join(f"{k.removeprefix(prefix).removesuffix('_bytes')} {v / GiB:.2f}"
                       for k, v in plan.items() if k.startswith(prefix))
    kernel = {v: k for k, v in GDN_KERNEL_CODES.items()}.get(plan.get("plan/gdn_kernel", 0.0), "none")
    gdn = {"none": "", "torch": " (GDN layers: transformers' torch fallback assumed)",
           "fla": " (GDN layers: flash-linear-attention assumed)"}[kernel]
    return f"{terms} GiB{gdn}"


def log_memory_plan(plan: dict[str, float]) -> None:
    g = {k.removeprefix("plan/"): v / GiB for k, v in plan.items() if k.endswith("_bytes")}
    log.info(
        "memory plan: engine weights %.2f GiB + KV pool %.2f GiB (~%d tokens) | trainer base %.2f GiB, LoRA+AdamW "
        "%.2f GiB, activations %.2f GiB (%d tokens/micro-batch) | device %.1f GiB", g["engine_weight_bytes"],
        g["kv_pool_bytes"], plan["plan/kv_tokens"], g["trainer_base_bytes"], g["trainer_lora_optimizer_bytes"],
        g["trainer_activation_bytes"], plan["plan/micro_batch_tokens"], g["device_total_bytes"])
    log.info("memory plan, trainer activations = %s", activation_terms_line(plan))
