"""Test fixtures of the trainer-side model (not used by the runtime): tiny random checkpoints (Qwen3, Qwen3.5
hybrid, Llama/SmolLM2-shaped) with an offline tokenizer, and a watcher that proves no dequantized weight exists.

Tests and CPU smoke runs need real HF checkpoint folders (config.json + bf16 safetensors + tokenizer)
without any download. `write_tiny_checkpoint("qwen3", dir)` builds one in well under a second.
"""


from __future__ import annotations

import functools
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast
from transformers import Qwen3Config
from torch.utils._python_dispatch import TorchDispatchMode

TINY_ARCHS = ("qwen3", "qwen3_5", "llama")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the format of SmolLM2-Instruct and Qwen: enough for data.py's chat templating in tests.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _training_corpus(seed: int = 0, lines: int = 2000) -> list[str]:
    """Arithmetic prompts and answers plus some English glue: what the CPU recipes feed the model."""
    rng = random.Random(seed)
    words = ("the answer is what compute solve sum of and then plus minus times equals "
             "please step by think final boxed result number question").split()
    corpus = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        filler = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
        corpus.append(f"What is {a} {op} {b}? {filler}. Answer: {eval(f'{a}{op}{b}')} \\boxed{{{a}}}")
    return corpus


@functools.lru_cache(maxsize=4)
def train_tiny_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained offline on `_training_corpus` (deterministic; cached per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_training_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, chat_template=CHAT_TEMPLATE)


def tiny_config(arch: str, vocab_size: int, eos_token_id: int, pad_token_id: int) -> PretrainedConfig:
    """hidden 64, 2-4 layers, GQA with 2 KV heads: small enough for CPU, shaped like the real thing."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, eos_token_id=eos_token_id,
                  pad_token_id=pad_token_id, bos_token_id=None)
    if arch == "qwen3":
        return Qwen3Config(**common, num_hidden_layers=2, head_dim=16, tie_word_embeddings=False)
    if arch == "llama":  # SmolLM2 is a Llama with tied embeddings
        return LlamaConfig(**common, num_hidden_layers=2, head_dim=16, tie_word_embeddings=True)
    if arch == "qwen3_5":  # 3 gated-DeltaNet layers then one full-attention layer, as in Qwen3.5
        from transformers.models.qwen3_5 import Qwen3_5TextConfig  # lazy: older transformers lack it

        return Qwen3_5TextConfig(
            **common, num_hidden_layers=4, head_dim=16, tie_word_embeddings=False,
            layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")


def write_tiny_checkpoint(arch: str, out_dir: str | Path, seed: int = 0,
                          dtype: torch.dtype = torch.bfloat16) -> str:
    """Write config.json, model.safetensors (random init, `dtype`) and the tokenizer; returns the folder."""
    out_dir = Path(out_dir)
    tokenizer = train_tiny_tokenizer()
    config = tiny_config(arch, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread_weights(model, seed)
    model.to(dtype).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def _spread_weights(model: torch.nn.Module, seed: int) -> None:
    """Give projections ~1/sqrt(fan_in) scale and norms non-trivial values.

    With HF's default std 0.02 a 64-wide random model is nearly a constant function: log-probs barely
    depend on the input, so tests comparing bases or gradients would pass vacuously.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
            elif name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


class ProjectionCopyWatcher(TorchDispatchMode):
    """Records every op output shaped like a projection weight ([N, K] or [K, N]) in a 16/32-bit dtype.

    Run a training step inside it to show that the FP8 path never materialises a dequantized weight
    (e.g. `codes.to(bf16)` before a GEMM). float64 is not watched: the CPU kernel references widen to
    float64 on purpose (exact accumulation) and are not the trainer's GPU path.
    """

    WATCHED = (torch.bfloat16, torch.float16, torch.float32)

    def __init__(self, weight_shapes):
        super().__init__()
        self.shapes = {tuple(s) for s in weight_shapes} | {tuple(reversed(tuple(s))) for s in weight_shapes}
        self.hits: list[tuple[str, tuple, torch.dtype]] = []

    @classmethod
    def for_policy(cls, policy) -> "ProjectionCopyWatcher":
        """Watches the policy's projection shapes, except those a LoRA factor shares (rank = a projection's
        width, e.g. Qwen3.5's in_proj_b/a at rank 32): a LoRA tensor of that shape is legitimate there."""
        watcher = cls([tuple(m.codes.shape) for m in policy.model.modules() if hasattr(m, "codes")])
        lora_shapes = {tuple(p.shape) for p in policy.lora_parameters()}
        watcher.shapes -= lora_shapes | {tuple(reversed(s)) for s in lora_shapes}
        return watcher

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype in self.WATCHED and tuple(t.shape) in self.shapes:
                self.hits.append((str(func), tuple(t.shape), t.dtype))
        return out
