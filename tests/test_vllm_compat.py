"""The vLLM boundary (`epirl.engine.vllm_compat`): every module's version check passes on the installed vLLM,
and nothing outside the package reaches into vLLM beyond its public interface.

A failing version check prints one line: `vLLM <version>: <symbol> is missing (<compat module>)`.
"""

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import epirl.engine.vllm_compat as vllm_compat  # noqa: E402
from epirl.engine.vllm_compat import kv_cache  # noqa: E402
from epirl.engine.vllm_compat.detect import missing_message, version_tuple, vllm_version  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMPAT_DIR = ROOT / "epirl" / "engine" / "vllm_compat"
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(COMPAT_DIR)]))

# vLLM's public interface: what code outside vllm_compat may import from vLLM.
PUBLIC_IMPORTS = {("vllm", None), ("vllm", "LLM"), ("vllm", "SamplingParams"), ("vllm.lora.request", "LoRARequest")}
# Names of vLLM internals epirl has reached for (and the obvious kin): outside vllm_compat, none may appear as an
# attribute, a name or an imported name.
PRIVATE_NAMES = {
    "model_executor", "driver_worker", "model_runner", "engine_core", "get_model", "_orig_mod", "lora_manager",
    "_load_adapter", "_adapter_manager", "from_lora_tensors", "PEFTHelper", "LoRAModel", "_get_logits",
    "LogitsProcessorWithLoRA", "BaseLinearLayerWithLoRA", "compute_logprobs", "sampler", "kv_caches",
    "CuMemAllocator", "pointer_to_data", "unmap_and_release", "create_and_map", "post_kv_cache_wake_up",
    "release_kv_cache_memory", "bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "punica_cpu", "torch_ops",
    "cleanup_dist_env_and_memory", "register_quantization_config", "QuantizationConfig", "LinearMethodBase",
    "ModelWeightParameter", "set_weight_attrs", "VocabParallelEmbedding", "ParallelLMHead", "EngineArgs",
    "QUANTIZATION_METHODS", "current_platform", "punica_wrapper", "token_lora_indices", "token_mapping_meta",
    "token_indices_sorted_by_lora_ids", "lora_a_stacked", "lora_b_stacked", "output_slices", "base_layer",
    "create_lora_weights",
}
# Where the rule applies: the installed package (epirl + the folders mapped into it). Tests and benchmark scripts
# may inspect vLLM's own ops and layers to compare against them.
SCANNED = [ROOT / "epirl", ROOT / "kernels", ROOT / "rewards", ROOT / "eval"]


@pytest.mark.parametrize("module", MODULES)
def test_installed_vllm_has_what_each_compat_module_relies_on(module):
    mod = importlib.import_module(f"epirl.engine.vllm_compat.{module}")
    assert callable(getattr(mod, "missing", None)), f"vllm_compat.{module} has no missing() version check"
    assert "Public API" in (mod.__doc__ or ""), f"vllm_compat.{module}: the docstring names no public replacement"
    lacking = mod.missing()
    assert not lacking, missing_message(lacking[0], f"vllm_compat.{module}")


def test_every_compat_module_is_listed_in_the_package_table():
    listed = {line.split("`")[1] for line in vllm_compat.__doc__.splitlines() if line.startswith("| `")}
    assert listed == set(MODULES)


def test_a_failed_check_is_one_line_naming_the_version_and_symbol():
    message = missing_message("vllm.x:Gone", "vllm_compat.kv_cache")
    assert "\n" not in message and message.startswith(f"vLLM {vllm_version()}: vllm.x:Gone is missing")


def test_kv_release_path_per_version():
    """The version gate of the KV path (docs/ARCHITECTURE.md's table); the installed version's path is checked
    by `kv_cache.missing()` above."""
    assert [kv_cache.path_for(v) for v in [(0, 26), (0, 27), (0, 28), (0, 30), (0, 31), (0, 33)]] == \
        ["manual"] * 4 + ["release_api"] * 2
    print(f"vLLM {vllm_version()}: KV release path {kv_cache.path_for(version_tuple())} (CUDA, sleep mode on)")


def _vllm_reaches(path: Path) -> list[str]:
    """`file:line name` for every non-public vLLM import and every private vLLM name in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{path}:{line} import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "vllm" and (a.name, None) not in PUBLIC_IMPORTS]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            found += [f"{path}:{line} from {node.module} import {a.name}" for a in node.names
                      if (node.module, a.name) not in PUBLIC_IMPORTS]
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
            found.append(f"{path}:{line} .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in PRIVATE_NAMES:
            found.append(f"{path}:{line} {node.id}")
    return found


def test_no_private_vllm_name_outside_the_compat_package():
    files = [p for folder in SCANNED for p in folder.rglob("*.py") if COMPAT_DIR not in p.parents]
    assert len(files) > 30
    reaches = [r for p in files for r in _vllm_reaches(p)]
    assert not reaches, "vLLM internals outside epirl/engine/vllm_compat: " + "; ".join(reaches[:10])


def test_the_grep_sees_a_private_reach(tmp_path):
    """The scan above can fail: a file with the reaches epirl used to make is flagged on each of them."""
    bad = tmp_path / "bad.py"
    bad.write_text("from vllm.lora.lora_model import LoRAModel\n"
                   "from vllm import SamplingParams\n"
                   "def f(llm, mgr):\n"
                   "    return llm.llm_engine.model_executor.driver_worker, mgr._load_adapter\n")
    assert sorted(r.split(" ", 1)[1] for r in _vllm_reaches(bad)) == [
        "._load_adapter", ".driver_worker", ".model_executor", "from vllm.lora.lora_model import LoRAModel"]
