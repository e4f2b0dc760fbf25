"""A model's architecture without its weights: the text config and a meta-device skeleton.

Shared by loading (which materialises the skeleton) and memory (which counts it), so neither imports the other.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig


def load_text_config(model_dir: str | Path) -> PretrainedConfig:
    """The language model's config (Qwen3.5 checkpoints are vision-language: take their text config)."""
    return AutoConfig.from_pretrained(str(model_dir)).get_text_config()


def build_skeleton(config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """The causal LM with every parameter on the meta device; buffers (rotary inv_freq) are real."""
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model
