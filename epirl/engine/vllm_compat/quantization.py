"""vLLM's out-of-tree quantization plugin API and its embedding classes, as the plugin uses them.

Read from vLLM 0.26 and 0.32 source: `vllm/model_executor/layers/quantization/__init__.py`
(`register_quantization_config(name)` decorator), `.../quantization/base_config.py` (`QuantizationConfig`:
`get_name`, `get_supported_act_dtypes`, `get_min_capability`, `get_config_filenames`, `from_config`,
`get_quant_method(layer, prefix)`), `vllm/model_executor/layers/linear.py` (`LinearBase`, `LinearMethodBase`:
`create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
params_dtype, **extra_weight_attrs)`, `process_weights_after_loading`, `apply(layer, x, bias)`),
`vllm/model_executor/parameter.py` (`ModelWeightParameter`), `vllm/model_executor/utils.py`
(`set_weight_attrs`), `vllm/model_executor/layers/vocab_parallel_embedding.py` (`VocabParallelEmbedding`,
`ParallelLMHead`).

Public API: this is vLLM's documented route for a quantization method outside its tree (the general-plugin
entry point + `register_quantization_config`); the classes it subclasses are not versioned interfaces, so
they are named here and checked per version.
"""

from __future__ import annotations

from epirl.engine.vllm_compat.detect import absent


def register(name: str, config_class: type) -> None:
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(name)(config_class)


def config_base() -> type:
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    return QuantizationConfig


def linear_base() -> type:
    from vllm.model_executor.layers.linear import LinearBase

    return LinearBase


def linear_method_base() -> type:
    from vllm.model_executor.layers.linear import LinearMethodBase

    return LinearMethodBase


def weight_parameter(data, weight_loader, extra_weight_attrs: dict):
    """A loadable [out, in] weight (`ModelWeightParameter`) with vLLM's extra attributes set."""
    from vllm.model_executor.parameter import ModelWeightParameter
    from vllm.model_executor.utils import set_weight_attrs

    weight = ModelWeightParameter(data=data, input_dim=1, output_dim=0, weight_loader=weight_loader)
    set_weight_attrs(weight, extra_weight_attrs)
    return weight


def embedding_classes() -> tuple[type, type]:
    """(VocabParallelEmbedding, ParallelLMHead): the token embedding and LM head layers."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return VocabParallelEmbedding, ParallelLMHead


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    return absent(["vllm.model_executor.layers.quantization:register_quantization_config",
                   "vllm.model_executor.layers.quantization.base_config:QuantizationConfig.get_quant_method",
                   "vllm.model_executor.layers.linear:LinearBase",
                   "vllm.model_executor.layers.linear:LinearMethodBase.create_weights",
                   "vllm.model_executor.parameter:ModelWeightParameter",
                   "vllm.model_executor.utils:set_weight_attrs",
                   "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding",
                   "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead"])
