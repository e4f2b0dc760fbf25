"""`model.load_format: dummy`: the real architecture with random weights, for capacity planning and throughput.

vLLM's and verl's `load_format: dummy` pattern: the engine builds the model from its config and fills every
weight with random values (vLLM's dummy loader), and the trainer does the same (seeded `RandomSource`), so
nothing but a config.json is needed — the GPU machines we measure on have no checkpoints and no hub. With
`trainer.base: shared` the trainer's projections and embeddings are the engine's (random) tensors and its other
tensors take the engine's values where vLLM names them alike (norms: `epirl.model.loading.take_engine_tensors`), so
Llama / Qwen3 engines and trainers compute one function (the bitwise pairing agrees bit for bit); Qwen3.5's small GDN
tensors, named otherwise by vLLM, keep the trainer's draw. With an own base (`fp8`, `bf16`) each side draws its own
weights. The post-publish probe is reported, not enforced, and results are never evaluated or resumed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from epirl.config import ConfigError, first_line, resolve_model_path

log = logging.getLogger(__name__)

SHIPPED_CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"
RANDOM_WEIGHTS_MARKER = "RANDOM_WEIGHTS"  # a file in adapters/checkpoints trained on random base weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def _cache_root() -> Path:
    return Path.home() / ".cache" / "epirl" / "dummy"


def shipped_config_dir(path: str) -> Path | None:
    """recipes/configs/<name>/ for a hub id or name whose last part names a shipped config (any case)."""
    name = path.rstrip("/").rpartition("/")[2].lower()
    if SHIPPED_CONFIGS.is_dir():
        for folder in SHIPPED_CONFIGS.iterdir():
            if folder.name.lower() == name and (folder / "config.json").is_file():
                return folder
    return None


def dummy_model_dir(path: str) -> Path:
    """A folder holding the architecture's config.json (and a tokenizer when one is at hand) for `model.path`.

    Order: a folder with config.json; a config.json file (copied into a cache folder: vLLM wants a folder);
    a config shipped under recipes/configs/; the hub id's config (downloaded once, written to the cache).
    Raises ConfigError (one line) when none applies."""
    resolved = resolve_model_path(path)
    local = Path(resolved).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.path: {path}: no config.json in this folder (model.load_format=dummy needs one)")
        return local
    if local.is_file():
        try:
            json.loads(local.read_text())
        except ValueError:
            raise ConfigError(f"model.path: {path}: not a JSON config file") from None
        return _cached_copy(local.read_text(), local.parent, tag=str(local.resolve()))
    shipped = shipped_config_dir(resolved)
    if shipped is not None:
        return shipped
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(resolved)
    except Exception as exc:  # noqa: BLE001 - offline, unknown id: one line
        reason = first_line(exc)
        shipped_names = sorted(p.name for p in SHIPPED_CONFIGS.iterdir()) if SHIPPED_CONFIGS.is_dir() else []
        raise ConfigError(f"model.path: {path}: no config for load_format=dummy ({reason}); give a config.json or "
                          f"one of {shipped_names}") from None
    return _cached_copy(config.to_json_string(), None, tag=resolved)


def _cached_copy(config_text: str, tokenizer_dir: Path | None, tag: str) -> Path:
    folder = _cache_root() / hashlib.sha256((tag + config_text).encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config_text)
    for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def prepare(cfg) -> str:
    """Make `cfg.model.path` the folder of the architecture's config (in place) and log the one line that says
    the weights are random. Returns the path the recipe gave."""
    given = cfg.model.path
    folder = dummy_model_dir(given)
    cfg.model.path = str(folder)
    tokenizer = cfg.model.tokenizer or (str(folder) if has_tokenizer(folder) else None)
    log.warning("model.load_format=dummy: RANDOM WEIGHTS with the architecture of %s (config %s/config.json); "
                "%s. Throughput and memory only: nothing this run learns means anything.", given, folder,
                f"tokenizer {tokenizer}" if tokenizer else "no tokenizer: token-id prompts")
    return given


def uses_tokenizer(cfg) -> bool:
    """Whether the run has a tokenizer (dummy configs may come without one)."""
    return cfg.model.load_format != "dummy" or cfg.model.tokenizer is not None or has_tokenizer(cfg.model.path)


def refuse_random_weights(folder: str | Path, what: str) -> None:
    """One-line error when `folder` (an adapter or checkpoint) was trained on random base weights."""
    folder = Path(folder)
    if (folder / RANDOM_WEIGHTS_MARKER).exists() or (folder.parent / RANDOM_WEIGHTS_MARKER).exists():
        raise ConfigError(f"{what} {folder}: trained on random base weights (model.load_format=dummy); its results "
                          "mean nothing and it is not evaluated or resumed")


def mark_random_weights(folder: str | Path) -> None:
    (Path(folder) / RANDOM_WEIGHTS_MARKER).write_text(
        "This adapter/checkpoint was trained on RANDOM base weights (model.load_format=dummy).\n")
