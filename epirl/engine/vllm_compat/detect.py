"""Which vLLM is installed and on which platform, and the one-line error for a symbol it lacks.

Read from: `vllm.__version__` and `vllm.platforms.current_platform` (0.26–0.33, unchanged). Public API: both
are public; nothing to replace.
"""

from __future__ import annotations

import re


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def version_tuple(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a vLLM version string (`0.32.0+cpu` → (0, 32)); (0, 0) when unparseable."""
    match = re.match(r"(\d+)\.(\d+)", version if version is not None else vllm_version())
    return (int(match[1]), int(match[2])) if match else (0, 0)


def on_cuda() -> bool:
    """True when vLLM's platform is CUDA (sleep mode, CuMemAllocator and FP8 kernels exist)."""
    from vllm.platforms import current_platform

    return bool(getattr(current_platform, "is_cuda", lambda: False)())


def missing_message(symbol: str, reach: str) -> str:
    """`vLLM 0.32.0: <symbol> is missing (<reach>)`: what a failed check says."""
    return f"vLLM {vllm_version()}: {symbol} is missing ({reach}); epirl reads vLLM 0.26-0.33"


def absent(symbols: list[str]) -> list[str]:
    """The symbols (`vllm.module:Attr.sub`) that the installed vLLM lacks: module not importable, or an
    attribute on the path missing."""
    import importlib

    lacking = []
    for symbol in symbols:
        module, _, path = symbol.partition(":")
        try:
            obj = importlib.import_module(module)
        except ImportError:
            lacking.append(symbol)
            continue
        for part in path.split(".") if path else []:
            if not hasattr(obj, part):
                lacking.append(symbol)
                break
            obj = getattr(obj, part)
    return lacking


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    return absent(["vllm:__version__", "vllm.platforms:current_platform"])
