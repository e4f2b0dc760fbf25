"""The rollout engine: vLLM in-process with an in-memory adapter slot (see `engine.py`).

`compat` holds every vLLM-version difference; `plugin` is the vLLM general plugin (matched W8A16
quantization method, CPU W8A8 emulation); `lora_publish` publishes adapters without files.
"""

from epirl.engine.engine import Completion, RolloutEngine

__all__ = ["RolloutEngine", "Completion"]
