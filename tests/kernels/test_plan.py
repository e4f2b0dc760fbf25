"""`kernels/plan.py` (CPU): `plan()` is pure and chooses, for H100 / H200 descriptions, what the dispatch chose before
it existed (`old_w8a16_dispatch.py`, a frozen copy of that logic)."""

import itertools

import pytest

import old_w8a16_dispatch as old
from epirl.kernels import plan as kplan
from epirl.kernels.plan import H100, H200, INTERPRETER, KernelSettings, plan

# Qwen3-8B (q/k/v fused 6144, o, gate/up 12288 each, gate_up fused 24576, down) and Qwen3.5-9B-like shapes, plus a
# ragged one
SHAPES = [(6144, 4096), (4096, 4096), (1024, 4096), (12288, 4096), (24576, 4096), (4096, 12288), (10240, 4096),
          (4096, 1024), (90, 600)]
TOKENS = [1, 3, 16, 17, 32, 33, 64, 65, 256, 257, 4096, 8192]
RANKS = [0, 16, 64, 128, 192]


def _same(new, was):
    assert new.kernel == was["kernel"]
    assert new.config == was["config"]
    assert new.pdl == was["pdl"]
    if was["kernel"] in ("ws_ticket", "ws_split"):
        assert new.fused_down == was["fused_down"]
    if was["kernel"] == "ws_gluon":
        assert (new.gluon, new.ring, new.persistent) == (was["gluon"], was["ring"], was["persistent"])
    if was.get("down") is None:
        assert new.down is None
    else:
        assert new.down.kernel == was["down"]["kernel"]
        if new.down.kernel == "ws_ticket":
            assert new.down.group == was["down"]["group"] and new.down.config == was["down"]["config"]


@pytest.mark.parametrize("device", [H100, H200], ids=["h100", "h200"])
@pytest.mark.parametrize("op", ["fwd", "dx"])
def test_plan_matches_the_old_dispatch(device, op):
    for (N, K), M, R, return_xa in itertools.product(SHAPES, TOKENS, RANKS, (False, True)):
        if op == "dx":
            N, K = K, N  # dX: w = codes.t(), the table's "dx" rows are keyed [K, N] of the codes
        xa_given = op == "dx" and R > 0  # dX passes gB as xa
        if op == "dx" and return_xa:
            continue
        was = old.weight_stationary_gemm(op, N, K, M, R, xa_given, return_xa, cuda=True, pdl_supported=True,
                                         groups_down=device.groups_down)
        new = plan("w8a16" if op == "fwd" else "w8a16_dx", (N, K), M, device, rank=R, xa_given=xa_given,
                   return_xa=return_xa)
        _same(new, was), (op, N, K, M, R, return_xa)


@pytest.mark.parametrize("device", [H100, H200], ids=["h100", "h200"])
def test_lora_down_plan_matches_the_old_dispatch(device):
    for (N, K), M, R, pdl in itertools.product(SHAPES, TOKENS, [16, 64, 192], (False, True)):
        was = old.lora_down(M, K, R, N, "fwd", pdl, device.groups_down)
        new = kplan.plan_lora_down(N, K, M, R, device, pdl=pdl)
        assert new.kernel == was["kernel"], (N, K, M, R, pdl)
        if new.kernel == "ws_ticket":
            assert (new.group, new.config) == (was["group"], was["config"]), (N, K, M, R, pdl)


def test_plan_is_pure_and_frozen():
    a = plan("w8a16", (6144, 4096), 16, H200, rank=64)
    b = plan("w8a16", (6144, 4096), 16, H200, rank=64)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.kernel = "ws_single"


def test_memo_follows_the_chunking_constants_and_the_table(monkeypatch, tmp_path):
    """`plan` is memoized, keyed also on what it reads besides its arguments: a patched chunking constant or a reloaded
    table gives a new plan."""
    from epirl.kernels.w8a16 import configs

    before = plan("w8a16", (4096, 4096), 16, H200, rank=64)
    assert plan("w8a16", (4096, 4096), 16, H200, rank=64) is before
    monkeypatch.setattr(configs, "TARGET_PROGRAMS", 64)
    assert plan("w8a16", (4096, 4096), 16, H200, rank=64).n_chunks != before.n_chunks
    monkeypatch.undo()
    configs.load_table.cache_clear()
    try:
        again = plan("w8a16", (4096, 4096), 16, H200, rank=64)
        assert again == before and again is not before
    finally:
        configs.load_table.cache_clear()


def test_representative_choices():
    """The committed table's picks, by name (what `epirl kernels explain` prints)."""
    decode = plan("w8a16", (6144, 4096), 1, H100, rank=64)
    assert (decode.kernel, decode.pdl, decode.down.kernel, decode.launches) == ("ws_ticket", True, "ws_ticket", 2)
    train = plan("w8a16", (6144, 4096), 8192, H100, rank=64, return_xa=True)
    assert train.kernel == "ws_gluon" and train.ring and train.down.kernel == "ws_down_single"
    dx = plan("w8a16_dx", (4096, 12288), 8192, H100, rank=64, xa_given=True)
    assert dx.kernel == "ws_gluon"
    # a rank whose LoRA tiles overflow shared memory at 256 tokens a tile: the forward narrows to 128
    o = plan("w8a16", (4096, 4096), 8192, H200, rank=128, return_xa=True)
    assert o.kernel == "ws_gluon" and o.gluon["BM"] == 128
    # H100 does not group lora_down's decode programs, H200 does (behind an 8-warp base tile)
    assert plan("w8a16", (4096, 12288), 16, H100, rank=64).down.group == 1
    assert plan("w8a16", (4096, 12288), 16, H200, rank=64).down.group > 1


def test_without_pdl_the_down_projection_rides_in_the_split_launch():
    p = plan("w8a16", (4096, 4096), 1, INTERPRETER, rank=16)
    assert (p.kernel, p.fused_down, p.down, p.launches) == ("ws_split", True, None, 2)
    assert plan("w8a16", (4096, 4096), 1, INTERPRETER).kernel == "ws_ticket"


def test_another_table_changes_the_tiles_only(tmp_path):
    import json

    from epirl.kernels.w8a16.configs import load_table

    table = json.loads(json.dumps(load_table()))
    table["fwd"]["default"]["1000000000"] = dict(BN=128, BM=128, BK=64, num_warps=8, num_stages=4, split=False)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    p = plan("w8a16", (90, 600), 8192, H200, settings=KernelSettings(table=str(path)))
    assert (p.kernel, p.tile) == ("ws_single", (128, 128, 64, 8, 4))
    assert p.k_chunk == plan("w8a16", (90, 600), 8192, H200).k_chunk


def test_reference_on_cpu_and_on_request():
    assert plan("w8a16", (64, 64), 4, kplan.CPU).kernel == "reference"
    assert plan("w8a16", (64, 64), 4, H100, settings=KernelSettings(reference=True)).kernel == "reference"


@pytest.mark.gpu
def test_the_gpu_at_hand_is_described_as_its_named_device():
    """On an H100 / H200 `describe` gives `plan.H100` / `plan.H200` (what `epirl kernels explain` plans for and what
    the test above compares with the old dispatch): capability, SMs, shared memory per CTA, PDL, grouping."""
    import torch

    got = kplan.describe(torch.device("cuda"))
    named = kplan.NAMED.get(got.name)
    if named is None:
        pytest.skip(f"not an H100 or H200: {torch.cuda.get_device_name()}")
    assert got == named, (got, named)
