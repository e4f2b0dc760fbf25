"""vLLM module names ↔ the trainer's (Hugging Face) module names, read from the model's own mappers.

The trainer is a transformers causal LM: `model.layers.0.self_attn.q_proj`. vLLM renames and fuses:
- prefixes: a vision-language checkpoint (Qwen3.5 ships as one) puts the text model under
  `language_model.model.` in vLLM and `model.language_model.` in the checkpoint (the model class's
  `hf_to_vllm_mapper.orig_to_new_prefix`);
- fusion: `qkv_proj` = q, k, v and `gate_up_proj` = gate, up (one logical output slice per member, the
  model's `packed_modules_mapping`), but also uneven ones such as Qwen3.5's GDN `in_proj_qkvz`, whose
  four slices (q, k, v, z) belong to two checkpoint modules, `in_proj_qkv` (slices 0-2) and `in_proj_z`
  (slice 3) — only the mappers' `orig_to_new_stacked` says which slice is whose.

Everything that crosses the boundary (the shared base's views, the matched engine's LoRA buffers, adapter
tensors handed to vLLM's own LoRA loader) goes through `NameMap`, so a name that cannot be mapped fails
loudly instead of silently training or serving nothing.
"""

from __future__ import annotations

from epirl.model.adapter_io import checkpoint_key
from epirl.model.weights import NESTED_TEXT_PREFIX, checkpoint_to_model_name

DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class NameMap:
    """The naming facts of one vLLM model instance (root module: `vllm_compat.model_access.model(llm)`)."""

    def __init__(self, model) -> None:
        mapper = getattr(type(model), "hf_to_vllm_mapper", None)
        # vLLM prefix → checkpoint prefix, from the root's mapper only (inner mappers see inner names).
        self.to_checkpoint_prefix = {new: orig for orig, new in
                                     (getattr(mapper, "orig_to_new_prefix", None) or {}).items() if new}
        self.packed = dict(getattr(model, "packed_modules_mapping", None) or {}) or dict(DEFAULT_PACKED)
        # fused leaf → [(member leaf, slice indices)], from every mapper in the model (inner models have them)
        self.stacked: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for module in model.modules():
            inner = getattr(type(module), "hf_to_vllm_mapper", None)
            for orig, target in (getattr(inner, "orig_to_new_stacked", None) or {}).items():
                fused, shards = target
                shards = (shards,) if isinstance(shards, int) else shards
                if isinstance(shards, tuple) and all(isinstance(i, int) for i in shards):
                    members = self.stacked.setdefault(fused.strip("."), [])
                    if (orig.strip("."), tuple(shards)) not in members:
                        members.append((orig.strip("."), tuple(shards)))

    @property
    def nests_text_model(self) -> bool:
        """The checkpoint keeps the text model under `model.language_model.` (vLLM maps it from there)."""
        return any(orig == NESTED_TEXT_PREFIX for orig in self.to_checkpoint_prefix.values())

    def hf_module(self, vllm_name: str) -> str:
        """`language_model.model.layers.0.mlp.down_proj` → `model.layers.0.mlp.down_proj`."""
        name = vllm_name.replace(".base_layer", "")
        prefix = max((p for p in self.to_checkpoint_prefix if name.startswith(p)), key=len, default=None)
        if prefix is not None:
            name = self.to_checkpoint_prefix[prefix] + name[len(prefix):]
        return checkpoint_to_model_name(name) or name

    def slices(self, vllm_name: str, widths: list[int]) -> list[tuple[str, int]]:
        """(HF module name, first row inside it) for each logical output slice of a vLLM linear layer.

        Unknown fusions keep the fused name: the caller's lookup then fails loudly."""
        name = self.hf_module(vllm_name)
        parent, _, leaf = name.rpartition(".")
        owners = self._owners(leaf, len(widths))
        if owners is None:
            owners = [leaf] * len(widths)
        out, rows = [], {}
        for owner, width in zip(owners, widths):
            full = f"{parent}.{owner}" if parent else owner
            out.append((full, rows.get(full, 0)))
            rows[full] = rows.get(full, 0) + width
        return out

    def _owners(self, leaf: str, count: int) -> list[str] | None:
        members = self.packed.get(leaf)
        if members and len(members) == count:
            return list(members)
        if leaf in self.stacked:
            owners: list[str | None] = [None] * count
            for member, shards in self.stacked[leaf]:
                for index in shards:
                    if index < count:
                        owners[index] = member
            if None not in owners:
                return owners  # type: ignore[return-value]
        return None

    def module_ranges(self, vllm_name: str, widths: list[int]) -> list[tuple[str, int, int]]:
        """(HF module name, first row, rows) of each member inside the fused output, in order."""
        ranges: dict[str, list[int]] = {}
        start, previous = 0, None
        for (name, _), width in zip(self.slices(vllm_name, widths), widths):
            if name in ranges and name != previous:
                raise RuntimeError(f"{vllm_name}: the slices of {name} are not contiguous; cannot map a view")
            ranges.setdefault(name, [start, 0])[1] += width
            start, previous = start + width, name
        return [(name, first, rows) for name, (first, rows) in ranges.items()]

    def vllm_adapter_key(self, peft_key: str) -> str:
        """A trainer PEFT key as the checkpoint would spell it, which is what vLLM's LoRA loader maps."""
        return checkpoint_key(peft_key, self.nests_text_model)
