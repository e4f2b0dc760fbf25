"""In-memory adapter publishing into vLLM's LoRA slot (no files).

The pattern (verl's TensorLoRARequest, rebuilt on a side table instead of a request subclass): vLLM's
worker turns a `LoRARequest` into weights in exactly one method, `WorkerLoRAManager._load_adapter`.
`vllm_compat.adapter_loader.install_adapter_loader` wraps it on the worker's manager instance; when the request's
`lora_int_id` is one we registered here, the wrapper builds the `LoRAModel` with
`LoRAModel.from_lora_tensors` from tensors held in this process, otherwise vLLM's own file loader runs.
A side table (id → tensors) rather than a `LoRARequest` subclass carrying tensors keeps the request a
plain msgspec struct, which every vLLM version serialises and hashes the same way.

Why a new name and id every step: vLLM's prefix cache is keyed by the LoRA name (blocks computed under
step k's adapter must never be reused under step k+1's), and its worker cache is keyed by the id.
Why clones: `LoRALayerWeights.optimize()` folds the scaling into B in place (`lora_b *= alpha/r`),
and `from_lora_tensors` keeps the caller's tensor when dtype/device already match; publishing the
trainer's tensors would silently rescale the trainer's B every step.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from epirl.engine.naming import NameMap
from epirl.engine.vllm_compat.adapter_loader import install_adapter_loader, lora_model_from_tensors, peft_helper
from epirl.engine.vllm_compat import model_access
from epirl.model.adapter_io import peft_adapter_config
from epirl.model.weights import checkpoint_to_model_name

log = logging.getLogger(__name__)

IN_MEMORY_SCHEME = "epirl-in-memory://"


@dataclass
class PublishedAdapter:
    """One adapter handed to vLLM: its request, and the exact (unscaled, cloned) tensors behind it."""

    request: Any  # vllm.lora.request.LoRARequest
    tensors: dict[str, torch.Tensor]  # PEFT names → clones, as published
    scale: float  # alpha / r, applied by the engine (vLLM folds it into B; the w8a16 path passes it)
    step: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """HF module path (`model.layers.0.self_attn.q_proj`) → (A [r, in], B [out, r]) unscaled."""


def modules_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Group PEFT tensor names into {module path: (A, B)}; fails on a half adapter."""
    a_s: dict[str, torch.Tensor] = {}
    b_s: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        stem = name[len("base_model.model."):] if name.startswith("base_model.model.") else name
        if stem.endswith(".lora_A.weight"):
            a_s[stem[: -len(".lora_A.weight")]] = t
        elif stem.endswith(".lora_B.weight"):
            b_s[stem[: -len(".lora_B.weight")]] = t
        else:
            raise ValueError(f"not a PEFT LoRA tensor name: {name!r}")
    if a_s.keys() != b_s.keys():
        raise ValueError(f"LoRA A/B mismatch for modules {sorted(a_s.keys() ^ b_s.keys())[:4]}")
    return {m: (a_s[m], b_s[m]) for m in a_s}


class AdapterPublisher:
    """Owns the engine's adapter slot: publish tensors in memory, one live adapter at a time."""

    def __init__(self, llm, rank: int, alpha: float, targets: list[str]):
        self._llm = llm
        self.rank, self.alpha, self.targets = int(rank), float(alpha), list(targets)
        self.scale = self.alpha / self.rank
        self._peft = peft_helper(peft_adapter_config(rank, alpha, targets))
        self._pending: dict[int, PublishedAdapter] = {}
        self._next_id = 1
        self.current: PublishedAdapter | None = None
        # The trainer's keys as the checkpoint spells them (Qwen3.5: `model.language_model.`), which is what
        # vLLM's LoRA loader maps onto its modules; unmapped names would be dropped without a word.
        self._names = NameMap(model_access.model(llm))
        install_adapter_loader(llm, self._load_in_memory)

    # -- worker side: called by vLLM (in this process) from inside `_load_adapter` -----------------

    def _load_in_memory(self, mgr, request) -> Any | None:
        adapter = self._pending.get(request.lora_int_id)
        if adapter is None:
            return None
        # Clone again at the vLLM boundary: vLLM owns (and scales in place) what it gets; our
        # `adapter.tensors` stay unscaled for the w8a16 path and for inspection.
        device = next(iter(adapter.tensors.values())).device
        vllm_tensors = {self._names.vllm_adapter_key(k): v.clone() for k, v in adapter.tensors.items()}
        return lora_model_from_tensors(mgr, request.lora_int_id, vllm_tensors, self._peft, str(device))

    # -- driver side --------------------------------------------------------------------------------

    def publish(self, lora_tensors: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        """Make `lora_tensors` (PEFT names, unscaled, rank/alpha/targets of the config) the live adapter.

        Remove-then-add under a fresh name and id; returns timing metrics. The caller's tensors are
        never handed to vLLM (clones are), so the trainer's parameters are untouched.
        """
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        clones = {k: v.detach().clone() for k, v in lora_tensors.items()}
        modules = modules_of(clones)
        bad = [m for m, (a, _) in modules.items() if a.shape[0] != self.rank]
        if bad:
            raise ValueError(f"adapter rank != config rank {self.rank} for {bad[:3]}")
        lora_id = self._next_id
        self._next_id += 1
        name = f"epirl-step{step}-id{lora_id}"
        request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=IN_MEMORY_SCHEME + name)
        adapter = PublishedAdapter(request, clones, self.scale, step, modules)
        t_clone = time.perf_counter()

        engine = self._llm.llm_engine
        if self.current is not None:
            engine.remove_lora(self.current.request.lora_int_id)
        # The live adapter stays loadable by id for as long as it is live: vLLM may reload it (LRU eviction
        # of its CPU cache) long after add_lora returned.
        self._pending = {lora_id: adapter}
        try:
            if not engine.add_lora(request):
                raise RuntimeError(f"vLLM refused adapter {name}")
        except BaseException:
            self._pending.pop(lora_id, None)
            raise
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.current = adapter
        t_end = time.perf_counter()
        return {
            "engine/publish_s": t_end - t0,
            "engine/publish_clone_s": t_clone - t0,
            "engine/publish_load_s": t_end - t_clone,
            "engine/adapter_id": float(lora_id),
        }

    def _respelled_copy(self, path: str, tensors: dict[str, torch.Tensor]) -> str:
        """`path`, or a temporary copy whose keys use the checkpoint's spelling (a text-model PEFT adapter on a
        vision-language checkpoint, e.g. from an older epirl or a text-only PEFT run)."""
        respelled = {self._names.vllm_adapter_key(k): v for k, v in tensors.items()}
        if respelled.keys() == tensors.keys():
            return path
        folder = tempfile.mkdtemp(prefix="epirl-adapter-")
        save_file({k: v.contiguous() for k, v in respelled.items()}, os.path.join(folder, "adapter_model.safetensors"))
        shutil.copy(os.path.join(path, "adapter_config.json"), folder)
        log.info("adapter %s: module names re-spelled for this checkpoint in %s", path, folder)
        return folder

    def use_directory(self, path: str, name: str | None = None) -> None:
        """Make a PEFT adapter folder on disk the live adapter (vLLM's own file loader)."""
        from vllm.lora.request import LoRARequest

        lora_id = self._next_id
        self._next_id += 1
        name = name or f"epirl-dir{lora_id}-{os.path.basename(os.path.normpath(path))}"
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        served = self._respelled_copy(path, tensors)  # vLLM's file loader maps only the checkpoint's spelling
        request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=os.path.abspath(served))
        engine = self._llm.llm_engine
        if self.current is not None:
            engine.remove_lora(self.current.request.lora_int_id)
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM refused adapter dir {path}")
        with open(os.path.join(path, "adapter_config.json")) as f:
            cfg = json.load(f)
        scale = float(cfg["lora_alpha"]) / float(cfg["r"])
        # Module keys as the trainer names them (a VL checkpoint's file says `model.language_model.`).
        modules = {checkpoint_to_model_name(m) or m: pair for m, pair in modules_of(tensors).items()}
        self.current = PublishedAdapter(request, tensors, scale, -1, modules)
