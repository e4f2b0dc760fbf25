"""Closing an in-process `LLM` so that the next one can start in the same process.

Read from vLLM 0.26 and 0.32 source: `vllm/v1/engine/llm_engine.py` (`LLMEngine.engine_core`, an
`EngineCoreClient` whose `shutdown()` stops the in-process core), `vllm/distributed/parallel_state.py`
(`cleanup_dist_env_and_memory()`: destroys the model-parallel groups and empties the device cache; vLLM's own
tests call it between engines).

Public API that would replace it: none in 0.26–0.33 (`LLM` has no `close()`/`shutdown()`); one would.
"""

from __future__ import annotations

import gc
import logging

from epirl.engine.vllm_compat.detect import absent

log = logging.getLogger(__name__)


def shutdown_llm(owner) -> None:
    """Stop the engine core of `owner.llm`, drop it (`owner.llm = None`: this frame then holds the last
    reference, so the collection below frees it) and free vLLM's process-wide state."""
    llm, owner.llm = owner.llm, None
    try:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    finally:
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception as e:  # best effort: a failed cleanup must not hide the caller's error
            log.warning("vLLM cleanup after close: %s", e)


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    return absent(["vllm.v1.engine.core_client:EngineCoreClient.shutdown",
                   "vllm.distributed.parallel_state:cleanup_dist_env_and_memory"])
