"""`epirl mismatch`: decompose the rollout-engine / trainer mismatch into δW, δA and δK.

    epirl mismatch --model smollm2 --engines bf16,w8a8,w8a16 --n-prompts 32 --samples 4 --out runs/mm

Samples completions from each engine precision (real vLLM, one engine at a time) with the engine's
top-k log-probs, scores the same tokens with three trainer variants on the same weights — (a) bf16
weights, (b) the engine's FP8 codes (the FP8 trainer), (c) FP8 codes with FP8 per-token activations —
and splits log p_engine − log p_(a) exactly into δW + δA + δK per token. Writes a table, mismatch.json
and mismatch.png (and W&B with --wandb). `measure_during_training` is the in-loop probe.
"""

from epirl.mismatch.measure import measure_during_training, measure_engines, summarize, verify_fake_quant
from epirl.mismatch.variants import VARIANTS, fake_quant_activations

__all__ = ["measure_during_training", "measure_engines", "summarize", "fake_quant_activations",
           "verify_fake_quant", "VARIANTS"]
