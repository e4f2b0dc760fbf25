"""Build the trainer's policy from a Hugging Face checkpoint: bf16 base, streamed FP8, or shared FP8.

Every path starts from a skeleton on the meta device (no memory) and materialises tensors one at a time:
- embeddings, norms, LM head, Qwen3.5's conv1d / A_log / dt_bias: `model.dtype` (bf16 on GPU), always;
- projections with `trainer.base: bf16`: the checkpoint weights in `model.dtype`, wrapped by `LoRALinear`;
- with `fp8`: quantized exactly as vLLM's online `fp8_per_tensor` (kernels/README.md, numerical contracts) with ONE scale per
  fused module (vLLM's `packed_modules_mapping`, below): all members of a group are read into one packed
  bf16 buffer, quantized together, and dropped. Peak memory = the FP8 model + one packed group in bf16.
- with `shared`: zero-copy views of the rollout engine's FP8 codes and scales, and of its token embedding
  and LM head (vLLM's vocab-padded weights, first V rows): no second copy of any large base tensor.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from epirl.config import check_lora_targets, concrete_dtype, resolve_model_path
from epirl.kernels import Fp8LoRALinear, quantize_weight_fp8, split_fused
from epirl.kernels.lora_linear.sliced import attach_slice_group
from epirl.model.lora import ALL_PROJECTIONS, init_lora_weights, inject_lora, projection_modules, replace_module
from epirl.model.bitwise import install_bitwise_forward
from epirl.model.fp8 import Fp8Linear
from epirl.model.linear_attention import select_gdn_kernel
from epirl.model.policy import Policy
from epirl.model.skeleton import build_skeleton, load_text_config
from epirl.model.weights import RandomSource, SafetensorsSource, checkpoint_to_model_name

log = logging.getLogger(__name__)

# vLLM packs these checkpoint projections into one linear layer and quantizes the packed weight with one
# scale (vllm/model_executor/models/{llama,qwen3,qwen3_5}.py `packed_modules_mapping`, vLLM 0.26-0.33).
PACKED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),  # Qwen3.5 gated DeltaNet
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
_PACKED_NAME_OF = {member: packed for packed, members in PACKED_MODULES.items() for member in members}
# The fused layers that run as one call (unless `kernels.fused_slices` is off): the matched engine (epirl.engine.plugin._one_call
# reads this list) and the trainer, which groups its modules the same way (`group_fused_layer`). Only qkv_proj: on
# the H200 one call is 0.54-0.66x the per-slice calls at decode and 0.92x bf16
# against 1.15x in training, but gate_up_proj as one call is 1.07x the per-slice calls at one token and
# 1.08-1.13x bf16 in training (its rank-128 epilogue and the wider tile cost more than one launch saves), and its
# column-view outputs make the MLP's elementwise ops strided. Qwen3.5's in_proj_qkvz (four slices in two
# modules) stays one call per slice on both sides.
ONE_CALL_LAYERS = ("qkv_proj",)


def runs_as_one_call(packed: str, fused_slices: bool = True) -> bool:
    """Whether the fused layer `packed` (vLLM's name: qkv_proj, gate_up_proj, ...) runs as one call with the run's
    `kernels.fused_slices`, in the engine and in the trainer alike."""
    return fused_slices and packed in ONE_CALL_LAYERS


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype of `model.dtype` on `device` (`auto` follows `epirl.config.concrete_dtype`)."""
    return DTYPES[concrete_dtype(name, device.type)]


def local_model_dir(path: str) -> Path:
    """A local checkpoint folder for `model.path` (aliases resolved; hub ids downloaded to the HF cache)."""
    resolved = resolve_model_path(path)
    if Path(resolved).is_dir():
        return Path(resolved)
    return Path(snapshot_download(resolved, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                             "*.jinja", "*.tiktoken"]))


def projection_groups(model: nn.Module) -> list[list[str]]:
    """Qualified names of all projections, grouped as vLLM fuses them (q,k,v / gate,up / qkv,z / b,a)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, _ in projection_modules(model, ALL_PROJECTIONS):
        parent, _, leaf = name.rpartition(".")
        groups.setdefault((parent, _PACKED_NAME_OF.get(leaf, leaf)), []).append(name)
    order = {member: i for members in PACKED_MODULES.values() for i, member in enumerate(members)}
    return [sorted(names, key=lambda n: order.get(n.rpartition(".")[2], 0)) for names in groups.values()]


def _set_tensor(model: nn.Module, qualified_name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = qualified_name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[leaf] = tensor


# Parameters vLLM holds in fp32 whatever the model dtype (Qwen3.5 / Qwen3-Next GDN decay: `A_log`); the
# trainer must hold the same values, and transformers upcasts them in the forward anyway.
FP32_PARAMS = {"A_log": torch.float32}


def materialize_params(model: nn.Module, source, device: torch.device, dtype: torch.dtype,
                       skip_modules: set[str], mapped: dict[str, torch.Tensor] | None = None) -> None:
    """Load every meta parameter outside `skip_modules` from `source` (or take it from `mapped`: tensors
    the engine already holds); tie embeddings; move buffers."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    mapped = mapped or {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if name.rpartition(".")[0] in skip_modules or not param.is_meta:
            continue
        if tied and name == "lm_head.weight":
            continue  # tied below to the embedding (SmolLM2 / Llama checkpoints have no lm_head tensor)
        if name in mapped:
            _set_tensor(model, name, mapped[name])
            continue
        if name not in source:
            raise KeyError(f"checkpoint has no tensor for {name}")
        _set_tensor(model, name, source.get(name, param.shape, FP32_PARAMS.get(name.rpartition(".")[2], dtype),
                                            device))
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    for name, buffer in list(model.named_buffers()):
        if buffer.device != device:
            _set_tensor(model, name, buffer.to(device))


def quantize_group(names: list[str], model: nn.Module, source, device: torch.device, dtype: torch.dtype
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Quantize one fused group as vLLM does: pack the members' weights, one amax, one scale.

    Returns {member name: (codes view [N_i, K] into the packed codes, shared scale [1])}.
    """
    shapes = [model.get_submodule(n).weight.shape for n in names]
    out_sizes = [s[0] for s in shapes]
    packed_W = torch.empty(sum(out_sizes), shapes[0][1], dtype=dtype, device=device)
    row = 0
    for name, size, shape in zip(names, out_sizes, shapes):
        # The engine quantizes the weight as it holds it, in the model dtype: read it in that dtype.
        packed_W[row:row + size].copy_(source.get(f"{name}.weight", shape, dtype, device))
        row += size
    codes_N_K, scale = quantize_weight_fp8(packed_W, group_sizes=out_sizes)
    del packed_W
    return {name: (codes, scale) for name, codes in zip(names, split_fused(codes_N_K, out_sizes))}


def _fp8_module(name: str, linear: nn.Module, codes_N_K: torch.Tensor, scale: torch.Tensor, trainable: bool,
                rank: int, alpha: float, seed: int, bias: torch.Tensor | None) -> nn.Module:
    out_features, in_features = codes_N_K.shape
    if (out_features, in_features) != tuple(linear.weight.shape):
        raise ValueError(f"{name}: FP8 codes {tuple(codes_N_K.shape)} != weight {tuple(linear.weight.shape)}")
    if not trainable:  # a projection outside lora.targets: FP8 base only, no adapter
        return Fp8Linear(codes_N_K, scale, bias)
    lora_a, lora_b = init_lora_weights(name, rank, in_features, out_features, seed)
    device = codes_N_K.device
    return Fp8LoRALinear(codes_N_K, scale, nn.Parameter(lora_a.to(device)), nn.Parameter(lora_b.to(device)),
                         alpha / rank, bias=bias)


def same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` are the same device when the current device is 0 (torch.device compares fields)."""
    index = lambda d: d.index if d.index is not None else (torch.cuda.current_device() if d.type == "cuda" else 0)
    return a.type == b.type and index(a) == index(b)


def mapped_embeddings(model: nn.Module, views: dict[str, torch.Tensor] | None, device: torch.device,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{parameter name: the engine's tensor, first V rows} for the token embedding and (untied) LM head.

    `views` is `engine.embedding_views()` ({"input", "output"}: vLLM's vocab-padded weights). A view
    that does not fit (other dtype or device, a quantized or missing head) is skipped with a log line:
    the trainer then loads its own copy, which is correct, only larger.
    """
    if not views:
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    roles = [("input", model.get_input_embeddings())]
    if not getattr(model.config, "tie_word_embeddings", False):
        roles.append(("output", model.get_output_embeddings()))
    mapped = {}
    for role, module in roles:
        view, (rows, width) = views.get(role), tuple(module.weight.shape)
        if view is None or view.dtype != dtype or not same_device(view.device, device) or view.ndim != 2 \
                or view.shape[1] != width or view.shape[0] < rows:
            log.info("trainer.base=shared: loading an own copy of the %s embedding (engine's: %s)", role,
                     None if view is None else f"{tuple(view.shape)} {view.dtype} on {view.device}")
            continue
        mapped[names[id(module)] + ".weight"] = view[:rows]  # vLLM pads the vocabulary; a prefix view
    return mapped


def normalize_view_names(views: dict) -> dict:
    """Engine view keys as this model's module names (drop `.weight`, map checkpoint prefixes)."""
    normalized = {}
    for key, value in views.items():
        name = checkpoint_to_model_name(key.removesuffix(".weight"))
        if name is not None:
            normalized[name] = value
    return normalized


def install_fp8_projections(model: nn.Module, source, device: torch.device, dtype: torch.dtype,
                            targets: list[str], rank: int, alpha: float, seed: int,
                            engine_views: dict | None = None, fused_slices: bool = True) -> None:
    """Replace every projection by an Fp8LoRALinear, one fused group at a time (fused_slices: `kernels.fused_slices`,
    the fused q, k, v as one call)."""
    if engine_views is not None:
        engine_views = normalize_view_names(engine_views)
        missing = [n for n, _ in projection_modules(model) if n not in engine_views]
        if missing:
            raise KeyError(f"engine.base_weight_views() lacks {len(missing)} projections, e.g. {missing[:3]}")
    for names in projection_groups(model):
        views = ({n: engine_views[n] for n in names} if engine_views is not None
                 else quantize_group(names, model, source, device, dtype))
        for name in names:
            linear = model.get_submodule(name)
            bias = None if linear.bias is None else source.get(f"{name}.bias", linear.bias.shape, dtype, device)
            codes_N_K, scale = views[name]
            trainable = name.rpartition(".")[2] in targets
            replace_module(model, name, _fp8_module(name, linear, codes_N_K, scale, trainable, rank, alpha,
                                                    seed, bias))
        group_fused_layer(model, names, fused_slices)


def group_fused_layer(model: nn.Module, names: list[str], fused_slices: bool = True) -> bool:
    """Group the FP8 modules `names` (one fused layer, slice order) to run as one call, the engine's
    (kernels/lora_linear/sliced.py), if it `runs_as_one_call`; a clear error if it cannot."""
    parent, _, leaf = names[0].rpartition(".")
    packed = _PACKED_NAME_OF.get(leaf)
    if not runs_as_one_call(packed, fused_slices) or tuple(n.rpartition(".")[2] for n in names) != PACKED_MODULES[packed]:
        return False
    try:
        attach_slice_group([model.get_submodule(n) for n in names])
    except ValueError as err:
        raise ValueError(f"{parent}.{packed}: {err} (one call per fused layer, as the engine runs it; "
                         "kernels.fused_slices=false runs one call per slice)") from None
    return True


def build_policy(config: PretrainedConfig, source, base: str, device: torch.device, dtype: torch.dtype,
                 rank: int, alpha: float, targets: list[str], seed: int, model_path: str,
                 gradient_checkpointing: bool = False, engine_views: dict | None = None,
                 engine_embeddings: dict | None = None, fused_slices: bool = True) -> Policy:
    """Skeleton → materialised base (bf16 / fp8 / shared) → LoRA on `targets` → Policy.

    `engine_views` / `engine_embeddings` (shared base): the engine's FP8 projection codes and its token
    embedding / LM head weights, mapped zero-copy instead of loaded. fused_slices: `kernels.fused_slices`."""
    if base not in ("bf16", "fp8", "shared"):
        raise ValueError(f"trainer.base must be bf16, fp8 or shared, got {base!r}")
    try:
        check_lora_targets(targets)
    except ValueError as exc:  # a config built without validation (tests, scripts): same one line
        raise ValueError(f"lora.targets: {exc}") from None
    model = build_skeleton(config, dtype)
    if base == "bf16":
        materialize_params(model, source, device, dtype, skip_modules=set())
        inject_lora(model, targets, rank, alpha, seed)
    else:
        projections = {name for name, _ in projection_modules(model)}
        mapped = mapped_embeddings(model, engine_embeddings, device, dtype) if base == "shared" else {}
        materialize_params(model, source, device, dtype, skip_modules=projections, mapped=mapped)
        for param in model.parameters():
            param.requires_grad_(False)
        install_fp8_projections(model, source, device, dtype, targets, rank, alpha, seed, engine_views, fused_slices)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise RuntimeError(f"parameters left on the meta device: {leftover[:4]}")
    if gradient_checkpointing:
        # Non-reentrant: works although the frozen embeddings' outputs do not require grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    policy = Policy(model, base, rank, alpha, targets, model_path)
    policy.linear_attention_kernel = select_gdn_kernel(model, device)  # Qwen3.5: fla if it works here, else torch
    if base == "shared":  # storages the engine owns: the memory report counts them apart
        engine_tensors = [t for pair in (engine_views or {}).values() for t in pair] + list(mapped.values())
        policy.engine_storages = {t.untyped_storage().data_ptr() for t in engine_tensors}
    return policy


def take_engine_tensors(model: nn.Module, engine_model: nn.Module) -> list[str]:
    """Random weights with `trainer.base: shared`: the trainer's own small tensors (norms, biases; what the engine's
    views do not map) take the values of the engine's tensors of the same name and shape, so that both sides compute
    one function, as with a checkpoint (each side's random draw would differ). Returns the names taken; the rest keep
    the trainer's draw (e.g. tensors vLLM names or shapes otherwise) and are logged."""
    engine_tensors = dict(engine_model.named_parameters())
    taken, kept = [], []
    for name, param in model.named_parameters():
        if param.requires_grad or param.is_meta or param.element_size() < 2:
            continue  # LoRA parameters; FP8 codes (the engine's views under trainer.base=shared)
        source = engine_tensors.get(name)
        if source is None or source.shape != param.shape:
            kept.append(name)
        elif source.data_ptr() != param.data_ptr():  # a mapped view is the engine's tensor already
            with torch.no_grad():
                param.copy_(source)
            taken.append(name)
    if kept:
        log.info("random weights: %d trainer tensors have no engine tensor of that name and shape (e.g. %s): "
                 "engine and trainer differ there", len(kept), kept[0])
    return taken


def load_policy(cfg, device, engine=None) -> Policy:
    """The trainer's policy for `cfg` (EpirlConfig): `trainer.base` bf16 | fp8 | shared (needs `engine`)."""
    device = torch.device(device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    model_dir = local_model_dir(cfg.model.path)
    engine_views = engine_embeddings = None
    if cfg.trainer.base == "shared":
        if engine is None:
            raise ValueError("trainer.base=shared needs the rollout engine (its FP8 weights are the base)")
        engine_views = engine.base_weight_views()
        engine_embeddings = engine.embedding_views() if hasattr(engine, "embedding_views") else None
    dummy = getattr(cfg.model, "load_format", "auto") == "dummy"  # tests may pass a bare namespace
    source = RandomSource(cfg.seed) if dummy else SafetensorsSource(model_dir)
    policy = build_policy(load_text_config(model_dir), source, cfg.trainer.base, device, dtype, cfg.lora.rank,
                          cfg.lora.alpha, list(cfg.lora.targets), cfg.seed, model_path=str(cfg.model.path),
                          gradient_checkpointing=cfg.trainer.gradient_checkpointing, engine_views=engine_views,
                          engine_embeddings=engine_embeddings, fused_slices=_fused_slices(cfg))
    # Saved adapters are named as this checkpoint is (a vision-language config nests the text model).
    policy.nests_text_model = (hasattr(AutoConfig.from_pretrained(str(model_dir)), "vision_config") if dummy
                               else source.nests_text_model)
    policy.random_weights = dummy
    if dummy and engine_views is not None:
        take_engine_tensors(policy.model, engine.vllm_model())
    if getattr(getattr(cfg, "engine", None), "bitwise", False):  # tests may pass a bare namespace without it
        make_bitwise(policy, load_text_config(model_dir))
    return policy


def make_bitwise(policy: Policy, text_config: PretrainedConfig) -> Policy:
    """The trainer's half of `engine.bitwise`: the decoder's norms, rotary, attention and activation run the invariant
    ops, and log-probs come from the exact LM head (`Policy.token_logprobs`)."""
    install_bitwise_forward(policy.model, text_config)
    policy.bitwise = True
    return policy


def random_policy(config: PretrainedConfig, base: str, device, rank: int, alpha: float, targets: list[str],
                  seed: int = 0, dtype: torch.dtype = torch.bfloat16, gradient_checkpointing: bool = False,
                  fused_slices: bool = True) -> Policy:
    """A policy with seeded random base weights generated on `device` (benchmarks, GPU memory tests)."""
    return build_policy(config, RandomSource(seed), base, torch.device(device), dtype, rank, alpha, targets, seed,
                        model_path=f"random:{config.model_type}", gradient_checkpointing=gradient_checkpointing,
                        fused_slices=fused_slices)


def _fused_slices(cfg) -> bool:
    """`kernels.fused_slices` (tests may pass a bare namespace without the section: the default)."""
    kernels = getattr(cfg, "kernels", None)
    return True if kernels is None else bool(kernels.fused_slices)
