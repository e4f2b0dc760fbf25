"""What the engine tells the layers vLLM builds: one object, passed through vLLM's `additional_config`.

vLLM builds the model's layers itself (through epirl's quantization method and the LoRA wrappers it patches), so the
engine cannot hand them arguments. It puts an `EngineSpec` under `additional_config["epirl"]` instead; the plugin reads
it where the layers are built (`current()`, while vLLM's config is in effect) and keeps what a layer needs on the
layer. `additional_config` is part of vLLM's config hash, which keys its torch.compile cache: a graph compiled under
other settings (another σ, fused slices on or off, another serving mode) is never replayed.

A plain `vllm serve` may pass the same object (`--additional-config '{"epirl": {...}}'`); without it the serving
kernels' mode comes from EPIRL_SERVING_KERNELS (`serving_lora.read_mode`) and the matched W8A16 layers get no LoRA.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from epirl.engine.vllm_compat import engine_args

KEY = "epirl"
SERVING_MODES = ("off", "fused", "timed")


@dataclass(frozen=True)
class EngineSpec:
    """lora_rank / lora_alpha: the matched W8A16 engine's LoRA buffers (rank 0: none) and σ = alpha / rank, which
    the fused op bakes into its graph; fused_slices: the fused q, k, v layer as one W8A16 call (`kernels.fused_slices`,
    the trainer groups its modules the same way); serving_kernels: "off" | "fused" | "timed", epirl's multi-adapter
    FP8 kernels in vLLM's LoRA layers (`engine.serving_kernels`); serving_vllm_from: batches of at least this many
    tokens take vLLM's own LoRA path in those layers (`kernels.serving_vllm_from`; None: never); bitwise: the norms,
    rotary embedding, activation, attention and LM head run epirl's batch-invariant ops (`engine.bitwise`,
    epirl/engine/vllm_compat/invariant_layers.py)."""

    lora_rank: int = 0
    lora_alpha: float = 0.0
    fused_slices: bool = True
    serving_kernels: str = "off"
    serving_vllm_from: int | None = None
    bitwise: bool = False

    def __post_init__(self):
        if self.serving_kernels not in SERVING_MODES:
            raise ValueError(f"serving_kernels {self.serving_kernels!r}: expected one of {SERVING_MODES}")

    @property
    def lora_scale(self) -> float:
        """σ = alpha / rank (1.0 without LoRA)."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 1.0

    def additional_config(self) -> dict:
        """The `additional_config` entry that carries this spec."""
        return {KEY: asdict(self)}

    @classmethod
    def from_additional_config(cls, config) -> EngineSpec | None:
        """The spec in a vLLM `additional_config` (None where it holds none). Unknown keys are refused: an engine
        and a plugin of different epirl versions must not silently disagree."""
        entry = config.get(KEY) if isinstance(config, dict) else None
        if entry is None:
            return None
        unknown = set(entry) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"additional_config[{KEY!r}]: unknown keys {sorted(unknown)}")
        return cls(**entry)


def current() -> EngineSpec | None:
    """The spec of the vLLM config in effect (while vLLM builds a model), else None."""
    return EngineSpec.from_additional_config(engine_args.current_additional_config())


def bitwise_now() -> bool:
    """Whether the spec in effect (while vLLM builds a model) asks for the bitwise layers (`EngineSpec.bitwise`)."""
    spec = current()
    return bool(spec is not None and spec.bitwise)
