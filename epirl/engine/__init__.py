"""The rollout engine: vLLM in-process with an in-memory adapter slot (see `engine.py`).

`vllm_compat` holds every reach into vLLM beyond its public interface (one module per reach, each with a
version check); `plugin` is the vLLM general plugin (matched W8A16 quantization method, CPU W8A8 emulation);
`lora_publish` publishes adapters without files; `naming` maps vLLM and trainer module names.
"""

from epirl.engine.engine import Completion, RolloutEngine

__all__ = ["RolloutEngine", "Completion"]
