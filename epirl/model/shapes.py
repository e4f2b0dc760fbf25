"""Configs of the production shapes (random weights, no checkpoint): benchmarks and GPU memory tests."""

from __future__ import annotations

from transformers import PretrainedConfig, Qwen3Config


def qwen3_8b_config(num_hidden_layers: int = 36) -> Qwen3Config:
    """Qwen/Qwen3-8B's text shapes (config.json of the hub checkpoint)."""
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=num_hidden_layers, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def qwen3_5_9b_config(num_hidden_layers: int = 32) -> PretrainedConfig:
    """Qwen/Qwen3.5-9B's text model: 3 gated-DeltaNet layers per full-attention layer."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig  # lazy: older transformers lack it

    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_hidden_layers)]
    return Qwen3_5TextConfig(vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                             num_hidden_layers=num_hidden_layers, num_attention_heads=16, num_key_value_heads=4,
                             head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                             linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                             layer_types=layer_types, tie_word_embeddings=False, rms_norm_eps=1e-6)


SHAPES = {"qwen3-8b": qwen3_8b_config, "qwen3.5-9b": qwen3_5_9b_config}
