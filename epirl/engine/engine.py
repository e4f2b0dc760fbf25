"""`RolloutEngine`: vLLM in-process, one adapter slot, three precisions.

The RL loop, eval and the mismatch tool talk to vLLM only through this class. It builds `vllm.LLM` in
this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the model, its FP8 tensors and the LoRA manager
are reachable as Python objects), samples with `processed_logprobs` (log-probs after temperature, the
same quantity the trainer recomputes), publishes the trainer's adapter in memory after every optimizer
step, and releases the KV cache around training. Every reach into vLLM beyond its public interface lives in
`vllm_compat`; the matched W8A16 method and the CPU W8A8 emulation live in `plugin`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import AutoConfig

from epirl.config import ENGINE_PRECISIONS, ConfigError, resolve_model_path
from epirl.engine import plugin, serving_lora
from epirl.engine.spec import EngineSpec
from epirl.engine.lora_publish import AdapterPublisher
from epirl.engine.vllm_compat import (cpu_lora_ops, engine_args, invariant_layers, invariant_sampler, kv_cache,
                                      logits_lora, model_access, prompt_logprobs, shutdown)
from epirl.engine.vllm_compat.detect import on_cuda, vllm_version
from epirl.model.dummy import uses_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Completion:
    """One sampled completion: tokens, their processed log-probs (after temperature), text, why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    """With `generate(..., logprobs=k)`: per position, the k most likely tokens' processed log-probs (plus the
    sampled token where it is not among them); empty otherwise."""


def quantization_method(precision: str) -> str | None:
    """vLLM `quantization=` for an engine precision (the plugin registers the epirl names)."""
    if precision == "bf16":
        return None
    if precision == "w8a16":
        return "epirl_w8a16"
    if precision == "w8a8":
        # vLLM's own FP8 engine on CUDA; vLLM has no W8A8 kernels on CPU, so the plugin emulates it
        # there with the kernels' references (same quantization contracts).
        return engine_args.fp8_per_tensor_method() if on_cuda() else "epirl_w8a8_emu"
    raise ValueError(f"engine.precision must be one of {ENGINE_PRECISIONS}, got {precision!r}")


def engine_spec(cfg: Any, serving: str | None = None) -> EngineSpec:
    """The settings the engine hands to the layers vLLM builds (epirl/engine/spec.py). serving: the resolved
    serving-kernels mode (default: `serving_mode(cfg, on_cuda())`)."""
    kernels = getattr(cfg, "kernels", None)
    return EngineSpec(lora_rank=int(cfg.lora.rank), lora_alpha=float(cfg.lora.alpha),
                      fused_slices=True if kernels is None else bool(kernels.fused_slices),
                      serving_kernels=serving_mode(cfg, on_cuda()) if serving is None else serving,
                      serving_vllm_from=None if kernels is None else kernels.serving_vllm_from,
                      bitwise=bool(getattr(cfg.engine, "bitwise", False)))


def llm_kwargs(cfg: Any, model_path: str, quantization: str | None) -> dict[str, Any]:
    """`vllm.LLM` arguments for an epirl config (one adapter slot, processed log-probs, the engine's spec)."""
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=cfg.model.dtype,
        max_model_len=cfg.model.max_model_len,
        max_num_seqs=cfg.engine.max_num_seqs,
        enforce_eager=cfg.engine.enforce_eager,
        enable_lora=True,
        max_lora_rank=engine_args.lora_rank_slot(cfg.lora.rank),
        max_loras=1,  # one live adapter; the previous one is removed on publish
        max_cpu_loras=2,
        seed=cfg.seed,
        logprobs_mode="processed_logprobs",  # after temperature: what the trainer recomputes
        quantization=quantization,
    )
    if on_cuda():
        kwargs["gpu_memory_utilization"] = cfg.engine.gpu_memory_utilization
        # Sleep mode puts weights and KV cache in CuMemAllocator pools, which is what lets the KV
        # cache be unmapped while the (shared) weights stay where they are.
        kwargs["enable_sleep_mode"] = bool(cfg.engine.kv_release)
    elif cfg.engine.precision != "bf16":
        # The CPU FP8 paths run the kernels' float64-exact references; vLLM's start-up profile pass
        # runs a full `max_num_batched_tokens` batch through them. Chunked prefill keeps long prompts
        # working with a small token budget.
        kwargs["max_num_batched_tokens"] = max(256, cfg.engine.max_num_seqs)
    if getattr(cfg.model, "load_format", "auto") == "dummy":  # random weights from the config (model.dummy)
        kwargs["load_format"] = "dummy"
        if cfg.model.tokenizer is not None:
            kwargs["tokenizer"] = resolve_model_path(cfg.model.tokenizer)
        elif model_path and not uses_tokenizer(cfg):
            kwargs["skip_tokenizer_init"] = True  # token-id prompts; no text is decoded
    if engine_args.llm_kwargs_supported(["additional_config"])["additional_config"]:
        # The layers vLLM builds read the spec from here (plugin, serving_lora), and additional_config is hashed into
        # the key of vLLM's torch.compile cache, which sees neither σ = alpha/r (a Python float the fused op bakes
        # into the graph), nor fused slices (they change the op's arguments in every qkv layer: a graph compiled
        # with the other setting fails at its first replay), nor the serving mode (what every LoRA layer traces):
        # a run with other settings never replays a graph compiled with the old ones.
        kwargs["additional_config"] = engine_spec(cfg).additional_config()
    kwargs.update(_extra_llm_kwargs(cfg, model_path, set(kwargs)))
    if getattr(cfg.engine, "bitwise", False) and on_cuda():
        kwargs["compilation_config"] = _bitwise_compilation(kwargs.get("compilation_config"))
    return kwargs


# cudagraph modes of a bitwise engine, its default first: both graph modes are bitwise over 40 loop steps, and
# PIECEWISE's TPOT is 2.4x FULL_AND_PIECEWISE's (BENCHMARKS.md § Bitwise pairing)
BITWISE_GRAPH_MODES = ("FULL_AND_PIECEWISE", "PIECEWISE", "NONE")
ATTENTION_OP = "vllm::unified_attention_with_output"


def _bitwise_compilation(compilation_config: Any) -> dict[str, Any]:
    """engine.bitwise on CUDA: FULL_AND_PIECEWISE CUDA graphs (default: decode batches, every query one row, replay
    one graph of the whole forward; the invariant attention is vLLM's backend impl, built before the capture, and
    reads its cache in place), PIECEWISE (vLLM runs the attention op eagerly between the captured pieces: the same
    bits, 2.4x the TPOT) or none. FULL would capture batches with longer queries too, whose kernel grid comes from
    the longest query (a host value a replay cannot change); FULL_DECODE_ONLY (prefill without graphs) would only be
    slower than FULL_AND_PIECEWISE. Splitting ops without the attention op would capture it inside a piece. Full
    graphs get one eager warm-up run with attention before each capture (`cudagraph_num_of_warmups`, unless set): the
    attention kernel compiles there, not inside a capture."""
    config = dict(compilation_config or {})
    mode = str(config.get("cudagraph_mode") or BITWISE_GRAPH_MODES[0]).upper()
    if mode not in BITWISE_GRAPH_MODES:
        raise ConfigError(f"engine.vllm_args.compilation_config.cudagraph_mode={mode}: engine.bitwise runs with "
                          f"{', '.join(BITWISE_GRAPH_MODES[:-1])} or {BITWISE_GRAPH_MODES[-1]}")
    splitting = config.get("splitting_ops")
    if "PIECEWISE" in mode and splitting is not None and ATTENTION_OP not in splitting:
        raise ConfigError(f"engine.vllm_args.compilation_config.splitting_ops: engine.bitwise with {mode} graphs "
                          f"needs {ATTENTION_OP} among them")
    config["cudagraph_mode"] = mode
    if mode.startswith("FULL"):
        config.setdefault("cudagraph_num_of_warmups", 1)
    return config


def check_vllm_args(cfg: Any) -> None:
    """Raise ConfigError (one line) now, before any model loads, for engine arguments vLLM would refuse."""
    try:
        llm_kwargs(cfg, "", None)
    except ConfigError:
        raise
    except ValueError as exc:  # the LoRA rank slot: vLLM allows a fixed set of max_lora_rank values
        raise ConfigError(f"lora.rank: {exc}") from None


def _extra_llm_kwargs(cfg: Any, model_path: str, owned: set[str]) -> dict[str, Any]:
    """`engine.vllm_args` (checked against this vLLM's EngineArgs), plus `language_model_only` for a
    multimodal checkpoint (Qwen3.5 ships as one): RL on text needs no vision tower in memory or profiling."""
    extra = dict(getattr(cfg.engine, "vllm_args", None) or {})
    taken = sorted(set(extra) & owned)
    if taken:
        raise ConfigError(f"engine.vllm_args.{taken[0]}: epirl sets this vLLM argument itself; use its config "
                         "field (model.* / engine.* / lora.*) instead")
    unknown = [name for name, ok in engine_args.llm_kwargs_supported(sorted(extra)).items() if not ok] if extra else []
    if unknown:
        raise ConfigError(f"engine.vllm_args.{unknown[0]}: not an argument of vLLM {vllm_version()}")
    if model_path and _is_multimodal(model_path) \
            and engine_args.llm_kwargs_supported(["language_model_only"])["language_model_only"]:
        extra.setdefault("language_model_only", True)
    return extra


def _is_multimodal(model_path: str) -> bool:
    config_file = Path(model_path, "config.json")
    if config_file.is_file():
        return "vision_config" in json.loads(config_file.read_text())
    try:  # a hub id: the config vLLM is about to read (cached or downloaded)
        return getattr(AutoConfig.from_pretrained(model_path), "vision_config", None) is not None
    except Exception:  # noqa: BLE001 - unknown here; vLLM will say what is wrong with the model itself
        return False


def serving_mode_for(cfg: Any, cuda: bool) -> str:
    """engine.serving_kernels resolved for this engine: `auto` is `timed` for a W8A8 engine on CUDA (where epirl's
    serving kernels run), else `env`."""
    chosen = getattr(cfg.engine, "serving_kernels", "env")
    if chosen == "auto":
        return "timed" if cuda and cfg.engine.precision == "w8a8" else "env"
    return chosen


def serving_mode(cfg: Any, cuda: bool) -> str:
    """The serving-kernels mode this engine's LoRA layers get: `serving_mode_for`, with `env` read from
    EPIRL_SERVING_KERNELS ("off" when unset)."""
    chosen = serving_mode_for(cfg, cuda)
    return serving_lora.read_mode() if chosen == "env" else chosen


class RolloutEngine:
    """vLLM rollout engine with an in-memory adapter slot (see module docstring)."""

    def __init__(self, cfg: Any, **llm_overrides: Any):
        """Start vLLM for `cfg` (EpirlConfig). `llm_overrides` go to `vllm.LLM` as is (benchmarks use
        `load_format="dummy"`, `skip_tokenizer_init=True`); the tokenizer is None without one."""
        engine_args.set_process_env(getattr(cfg.engine, "cpu_kv_cache_gb", None))
        plugin.register()  # idempotent; the entry point also calls it when vLLM loads plugins
        # engine.serving_kernels: its LoRA layers read the mode from the engine's spec (additional_config) when vLLM
        # builds them; the wrappers that route them to epirl's kernels go in first (idempotent)
        if serving_mode(cfg, on_cuda()) != "off":
            serving_lora.install()
        if not on_cuda():
            cpu_lora_ops.install()  # vLLM's CPU LoRA ops gather weights per token: ~2x slower generate
        if getattr(cfg.engine, "bitwise", False):
            invariant_layers.register_layers()  # before vLLM builds the model: its norms, rotary, activation and head
            invariant_layers.forget_cached_rotary()
        import vllm  # only when an engine starts: importing vLLM takes seconds

        self.cfg = cfg
        self.precision = cfg.engine.precision
        quantization = quantization_method(self.precision)
        self.model_path = resolve_model_path(cfg.model.path)
        t0 = time.perf_counter()
        kwargs = llm_kwargs(cfg, self.model_path, quantization)
        kwargs.update(llm_overrides)
        self.llm = vllm.LLM(**kwargs)
        self.start_s = time.perf_counter() - t0
        log.info("vLLM %s engine (%s, quantization=%s) started in %.1f s",
                 vllm_version(), self.precision, quantization, self.start_s)
        self.tokenizer = None if kwargs.get("skip_tokenizer_init") else self.llm.get_tokenizer()
        logits_lora.bypass_logits_lora(self.llm)  # adapters never touch lm_head; see logits_lora for the CPU bug
        self._publisher = AdapterPublisher(self.llm, cfg.lora.rank, cfg.lora.alpha, list(cfg.lora.targets))
        self._fused = plugin.attach(self.llm, self.precision)  # w8a16: the fused LoRA path's buffers; else None
        self._undo_sampler = None  # engine.bitwise: puts vLLM's sampler functions back on close
        if getattr(cfg.engine, "bitwise", False):
            invariant_layers.forget_cached_rotary()
            try:
                from epirl.engine.vllm_compat import invariant_attention  # imports vLLM's backends

                invariant_attention.check_attention(self.llm)
                invariant_layers.check_model(self.llm)
                self._undo_sampler = invariant_sampler.install(self.llm)
            except invariant_layers.BitwiseUnsupported as exc:  # one line, and the engine's memory given back
                self.close()
                raise ConfigError(str(exc)) from None
        self._kv_released = False
        self._kv_released_bytes = 0
        self._weight_checksums = self._checksum_weights() if self.kv_release_mode != "none" else {}

    # ------------------------------------------------------------------------------------------------
    # Sampling and scoring
    # ------------------------------------------------------------------------------------------------

    @property
    def adapter(self):
        """The live `PublishedAdapter` (None before the first publish)."""
        return self._publisher.current

    def lora_request(self, use_adapter: bool = True):
        """vLLM's `LoRARequest` of the live adapter (None without one, or with `use_adapter=False`)."""
        current = self._publisher.current
        return current.request if (use_adapter and current is not None) else None

    @contextlib.contextmanager
    def serving(self, lora_request) -> Iterator[None]:
        """Around a direct `self.llm.generate(..., lora_request=lora_request)` (benchmarks): the matched
        engine's fused layers hold that adapter (or none). `generate` / `score` do this themselves."""
        with plugin.active_adapter(self._fused, self.adapter if lora_request is not None else None):
            yield

    def generate(self, prompt_ids_P: list[list[int]], n: int, max_tokens: int, temperature: float,
                 top_p: float = 1.0, seed: int | None = None, use_adapter: bool = True, logprobs: int = 0,
                 ignore_eos: bool = False, seeds: list[int] | None = None) -> list[list[Completion]]:
        """n samples per prompt with the sampled tokens' processed log-probs; returns [P][n].

        `logprobs=k` > 0 also returns the k most likely tokens at every position (`Completion.top_logprobs`,
        vLLM's `SamplingParams.logprobs`; at most the engine's `max_logprobs`, 20 by default). `ignore_eos`: every
        sample runs to `max_tokens` (benchmarks that force the longest responses). `seeds` (one per prompt) give
        each prompt its own sampler: its samples do not depend on the batch around it."""
        from vllm import SamplingParams

        self._check_awake()
        if seeds is not None and len(seeds) != len(prompt_ids_P):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompt_ids_P)} prompts")
        per_prompt = [seed] * len(prompt_ids_P) if seeds is None else list(seeds)
        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=s,
                                 logprobs=logprobs, detokenize=self.tokenizer is not None, ignore_eos=ignore_eos)
                  for s in per_prompt]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids_P]
        lora = self.lora_request(use_adapter)
        with self.serving(lora):
            outs = self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        result = []
        for out in outs:
            group = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = [c.logprobs[i][t].logprob for i, t in enumerate(ids)] if ids else []
                top = ([{token: lp.logprob for token, lp in c.logprobs[i].items()} for i in range(len(ids))]
                       if logprobs else [])
                group.append(Completion(ids, lps, c.text or "", c.finish_reason or "length", top))
            result.append(group)
        return result

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
              temperature: float = 1.0, use_adapter: bool = True) -> list[list[float]]:
        """log p(completion token | prefix) under the engine, after temperature, one list per pair.

        Uses vLLM's prompt log-probs over prompt+completion (max_tokens=1); see
        `vllm_compat.prompt_logprobs` for how T != 1 is honoured.
        """
        from vllm import SamplingParams

        self._check_awake()
        if len(prompt_ids) != len(completion_ids):
            raise ValueError("score: prompt_ids and completion_ids differ in length")
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        prompts = [{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompt_ids, completion_ids)]
        lora = self.lora_request(use_adapter)
        with self.serving(lora), prompt_logprobs.prompt_temperature(self.llm, temperature):
            outs = self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        result = []
        for out, p, c in zip(outs, prompt_ids, completion_ids):
            plp = out.prompt_logprobs
            result.append([plp[len(p) + j][t].logprob for j, t in enumerate(c)])
        return result

    # ------------------------------------------------------------------------------------------------
    # Adapter slot
    # ------------------------------------------------------------------------------------------------

    def publish(self, lora_tensors: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        """Publish the trainer's adapter in memory (clones; new name and id). Returns metrics.

        Allowed while the KV cache is released: the loop publishes right after training, before the
        re-acquire, and the adapter slots are weights-side memory that a release never touches.
        """
        return self._publisher.publish(lora_tensors, step)

    def load_adapter_dir(self, path: str) -> None:
        """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) becomes the live adapter."""
        self._publisher.use_directory(path)

    # ------------------------------------------------------------------------------------------------
    # KV cache release around training; shared FP8 base
    # ------------------------------------------------------------------------------------------------

    def release_kv(self) -> dict[str, float]:
        """Free the KV cache (weights stay). Logged no-op where vLLM has no sleep mode (CPU)."""
        mode = self.kv_release_mode
        if self._kv_released:  # a second release would unmap unmapped memory (or raise, by vLLM version)
            return {"engine/kv_released_bytes": 0.0, "engine/kv_release_s": 0.0}
        if mode == "none" or not self.cfg.engine.kv_release:
            log.debug("release_kv: no-op (mode=%s, kv_release=%s)", mode, self.cfg.engine.kv_release)
            return {"engine/kv_released_bytes": 0.0, "engine/kv_release_s": 0.0}
        metrics = kv_cache.release_kv(self.llm)
        if getattr(self.cfg.engine, "bitwise", False):  # the invariant attention's slot stores go with the cache
            from epirl.engine.vllm_compat import invariant_attention

            metrics["engine/kv_released_bytes"] += invariant_attention.drop_slot_stores(self.llm)
        self._kv_released = True
        self._kv_released_bytes = int(metrics["engine/kv_released_bytes"])
        log.info("released KV cache (%s): %.2f GiB in %.3f s", mode,
                 metrics["engine/kv_released_bytes"] / 2**30, metrics["engine/kv_release_s"])
        return metrics

    def reacquire_kv(self) -> dict[str, float]:
        """Map the KV cache back and verify the resident weights were not touched (fails loudly)."""
        if not self._kv_released:
            return {"engine/kv_reacquired_bytes": 0.0, "engine/kv_reacquire_s": 0.0}
        self._check_room_for_kv()
        metrics = kv_cache.reacquire_kv(self.llm)
        self._kv_released = False
        t0 = time.perf_counter()
        now = self._checksum_weights()
        bad = [k for k in self._weight_checksums if now.get(k) != self._weight_checksums[k]]
        if bad:
            raise RuntimeError(f"engine weights changed across KV release/re-acquire: {bad}")
        metrics["engine/weight_check_s"] = time.perf_counter() - t0
        return metrics

    def _check_room_for_kv(self) -> None:
        """The trainer's cached blocks go back to the driver first; then the KV pool must fit again.

        Without the empty_cache(), PyTorch's caching allocator keeps the training peak reserved and
        mapping the KV cache back fails with an opaque CUDA error in the middle of a run.
        """
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        needed = self._kv_released_bytes
        if free < needed:
            raise RuntimeError(
                f"cannot re-acquire the KV cache: it needs {needed / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free after "
                "training; lower trainer.micro_batch_size or engine.gpu_memory_utilization, or set "
                "trainer.gradient_checkpointing=true")

    def _check_awake(self) -> None:
        if self._kv_released:
            raise RuntimeError("engine KV cache is released: call reacquire_kv() before using the engine")

    def _checksum_weights(self, count: int = 4) -> dict[str, tuple[int, int]]:
        """Exact fingerprints of a few weight tensors spread over the model (first ... last).

        Two integer sums over the raw bits (plain and position-weighted, int64 wrap-around is fine for
        a fingerprint): any changed byte changes them, and no float rounding can hide a change.
        """
        params = [(n, p) for n, p in self.vllm_model().named_parameters() if p.numel() > 0]
        if not params:
            return {}
        picks = {params[i * (len(params) - 1) // max(count - 1, 1)] for i in range(count)}
        int_of_width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        out = {}
        chunk = 1 << 22  # int64 temporaries of 4M elements: ~100 MB however large the tensor (embeddings: GBs)
        for name, p in sorted(picks, key=lambda item: item[0]):
            flat = p.detach().reshape(-1)
            raw = flat.view(int_of_width[flat.element_size()])
            plain = weighted = 0
            for start in range(0, raw.numel(), chunk):
                bits = raw[start:start + chunk].to(torch.int64)
                position = torch.arange(start + 1, start + bits.numel() + 1, device=bits.device)
                plain += int(bits.sum())
                weighted += int((bits * position).sum())
            out[name] = (plain, weighted)
        return out

    def base_weight_views(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Zero-copy views of the engine's FP8 base: {HF module name: (codes [N, K], scale [1])}.

        For `trainer.base: shared`. Fused modules (qkv_proj, gate_up_proj) are split by their logical
        output widths; every view shares storage with the engine's weight (equal data_ptr for the first
        slice). Only FP8 precisions have codes to share.
        """
        return plugin.fp8_base_views(self.vllm_model())

    def embedding_views(self) -> dict[str, torch.Tensor]:
        """The engine's token embedding / LM head weights ({"input", "output"}: [V_padded, H], zero-copy),
        for `trainer.base: shared` to map instead of loading its own 16-bit copies."""
        return plugin.embedding_views(self.vllm_model())

    def vllm_model(self) -> torch.nn.Module:
        """The model vLLM runs, as a live module (layer checks, checksums, shared views)."""
        return model_access.model(self.llm)

    @property
    def kv_release_mode(self) -> str:
        """How this engine releases its KV cache: `release_api`, `manual` or `none` (see vllm_compat.kv_cache)."""
        return kv_cache.kv_release_mode(self.llm)

    def close(self) -> None:
        """Shut vLLM down and free its memory (so a next engine can start in this process)."""
        if getattr(self, "_undo_sampler", None) is not None:
            self._undo_sampler()
            self._undo_sampler = None
        if getattr(self, "llm", None) is not None:
            self._fused = None
            shutdown.shutdown_llm(self)
