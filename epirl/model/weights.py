"""Where base tensors come from, one tensor at a time: safetensors shards, or seeded random values.

Both sources answer `get(model_param_name, shape, dtype, device)` so the loaders never hold more than the
tensors they are working on (streaming is what keeps peak memory at "FP8 model + one fused group").
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

# Checkpoint prefixes → model prefixes. Qwen3.5 checkpoints are vision-language ones: the text model lives
# under `model.language_model.`, which vLLM maps to `model.` too; vision tower and MTP head are dropped.
NESTED_TEXT_PREFIX = "model.language_model."
CHECKPOINT_PREFIX_MAP = ((NESTED_TEXT_PREFIX, "model."),)
CHECKPOINT_SKIP_PREFIXES = ("model.visual.", "visual.", "mtp.")


def checkpoint_to_model_name(name: str) -> str | None:
    if name.startswith(CHECKPOINT_SKIP_PREFIXES):
        return None
    for old, new in CHECKPOINT_PREFIX_MAP:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class SafetensorsSource:
    """Tensors of a local HF checkpoint folder (single file or sharded with an index), read lazily."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            single = self.model_dir / "model.safetensors"
            if not single.exists():
                raise FileNotFoundError(f"{self.model_dir}: no model.safetensors(.index.json)")
            with safe_open(str(single), "pt") as f:
                weight_map = {k: single.name for k in f.keys()}
        self._file_of: dict[str, tuple[str, str]] = {}  # model name -> (shard file, checkpoint name)
        for ckpt_name, shard in weight_map.items():
            model_name = checkpoint_to_model_name(ckpt_name)
            if model_name is not None:
                self._file_of[model_name] = (shard, ckpt_name)
        self._handles: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    @property
    def nests_text_model(self) -> bool:
        """A vision-language checkpoint (Qwen3.5): the text model's tensors live under `model.language_model.`."""
        return any(ckpt.startswith(NESTED_TEXT_PREFIX) for _, ckpt in self._file_of.values())

    def get(self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        shard, ckpt_name = self._file_of[name]
        if shard not in self._handles:  # safe_open memory-maps: reading one tensor touches only its bytes
            self._handles[shard] = safe_open(str(self.model_dir / shard), "pt")
        tensor = self._handles[shard].get_tensor(ckpt_name)
        if tensor.shape != shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(shape)}")
        return tensor.to(device=device, dtype=dtype)


class RandomSource:
    """Seeded random weights generated on the target device (benchmarks of 8B shapes without a checkpoint).

    Matrices ~ N(0, 1/fan_in) so activations keep their scale through depth; 1-D tensors are ones
    (norm gains; Qwen3.5's (1 + w) norms then scale by 2, harmless for timing), `A_log` zeros.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed

    def __contains__(self, name: str) -> bool:
        return True

    def get(self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if len(shape) == 1:
            fill = 0.0 if name.endswith("A_log") else 1.0
            return torch.full(tuple(shape), fill, dtype=dtype, device=device)
        generator = torch.Generator(device=device).manual_seed(self.seed * 7919 + zlib.crc32(name.encode()))
        out = torch.randn(tuple(shape), generator=generator, device=device, dtype=dtype)
        return out.mul_(1.0 / math.sqrt(math.prod(shape[1:])))
