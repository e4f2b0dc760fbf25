"""`epirl kernels explain` on CPU: one table of what the W8A16 kernels run per projection and token count, planned for
an H100 or H200 description (epirl.kernels.plan)."""

import json

import pytest

from epirl.cli import main
from epirl.kernels_cli import explain_rows, load_model_config, projections
from epirl.kernels.plan import H100, H200


def test_explain_prints_one_row_per_projection_tokens_and_call(capsys):
    assert main(["kernels", "explain", "--tokens", "1", "4096", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = ["qkv", "o", "gate", "up", "down"]  # Qwen3-8B, q, k, v as one call
    assert [r["projection"] for r in rows[::6]] == names and len(rows) == len(names) * 2 * 3
    by = {(r["projection"], r["tokens"], r["call"]): r for r in rows}
    assert by["qkv", 1, "engine"]["shape"] == "6144x4096" and by["down", 1, "engine"]["shape"] == "4096x12288"
    decode = by["o", 1, "engine"]  # decode: lora_down first, the split-K base GEMM its PDL dependent
    assert (decode["kernel"], decode["pdl"], decode["lora_down"], decode["launches"]) == ("ws_ticket", "yes",
                                                                                          "ws_ticket", 2)
    train = by["qkv", 4096, "trainer"]  # the fused qkv (rank 192) streams its LoRA through the Gluon ring
    assert train["kernel"] == "ws_gluon" and train["loads"] == "Gluon ring" and train["lora_down"] == "ws_down_single"
    assert by["down", 4096, "dX"]["kernel"] == "ws_tma"


def test_explain_table_names_model_device_and_kernels(capsys):
    assert main(["kernels", "explain", "--model", "Qwen3.5-9B", "--tokens", "16", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3.5-9B on H200" in out and "in_proj_qkv" in out and "ws_ticket" in out and "10240x4096" in out


def test_projections_follow_the_config_and_the_fused_slices_setting():
    qwen3 = load_model_config("Qwen3-8B")
    assert projections(qwen3)[0] == ("qkv", 6144, 4096, 3)
    assert [p[:3] for p in projections(qwen3, fused_slices=False)[:3]] == [("q", 4096, 4096), ("k", 1024, 4096),
                                                                          ("v", 1024, 4096)]
    qwen35 = dict(load_model_config("Qwen3.5-9B"))
    assert projections(qwen35)[0][1] == 10240  # a gated attention's q_proj holds the gate too
    # H200 groups lora_down's decode programs behind down's 8-warp tile, H100 does not (measured)
    rows = {d.name: {(r["projection"], r["call"]): r for r in explain_rows(qwen3, [16], d)} for d in (H100, H200)}
    assert rows["h200"]["down", "engine"]["lora_down"].startswith("ws_ticket x")
    assert rows["h100"]["down", "engine"]["lora_down"] == "ws_ticket"


def test_unknown_model_is_one_line(capsys):
    assert main(["kernels", "explain", "--model", "no-such-model"]) == 2
    assert "recipes/configs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["kernels", "explain", "--device", "a100"])
