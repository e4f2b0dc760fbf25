"""The committed W8A16 tile table and K chunking (CPU): valid entries, chunking independent of M."""

import pytest

import epirl.kernels as kernels
from epirl.kernels.w8a16.configs import CHUNK_ALIGN, CONFIG_KEYS, k_chunking, load_table, ws_config
from epirl.kernels.w8a16.weight_stationary import whole_k


def test_every_table_entry_is_complete_and_divides_the_chunk():
    table = load_table()
    for op in ("fwd", "dx"):
        for shape, row in table[op].items():
            assert row, (op, shape)
            for bound, cfg in row.items():
                assert int(bound) > 0 and set(CONFIG_KEYS) <= set(cfg), (op, shape, bound)
                assert CHUNK_ALIGN % cfg["BK"] == 0, (op, shape, bound, cfg)
                assert cfg["BN"] >= 64 and cfg["num_warps"] >= 4, "wgmma needs a 64-row warpgroup tile"
                if "gluon" in cfg:  # the Gluon kernel takes k-steps in pairs: a chunk must hold an even number
                    N, K = map(int, shape.split("x"))
                    k_chunk = k_chunking(N, K)[0] if op == "fwd" else whole_k(K)[0]
                    assert k_chunk % (2 * cfg["gluon"]["BK"]) == 0, (op, shape, bound, cfg)


@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 12288), (1024, 4096), (90, 600), (24576, 4096)])
def test_chunking_covers_k_in_aligned_chunks(N, K):
    chunk, n = k_chunking(N, K)
    assert chunk % CHUNK_ALIGN == 0 and (n - 1) * chunk < K <= n * chunk


def test_config_lookup_picks_the_first_bucket_at_or_above_m():
    bounds = sorted(int(b) for b in load_table()["fwd"]["default"])
    for M in (1, bounds[0], bounds[0] + 1, 10 ** 6):
        want = next((b for b in bounds if M <= b), bounds[-1])
        assert ws_config("fwd", 123, 456, M) == load_table()["fwd"]["default"][str(want)]


def test_no_public_function_shares_its_name_with_a_subpackage():
    """Every op's function is what `epirl.kernels.<name>` is, whichever of the op folders' modules load, and no
    subpackage of epirl.kernels is named like one of its public functions (a later import would rebind the name)."""
    import importlib
    import pkgutil

    subpackages = {m.name for m in pkgutil.iter_modules(kernels.__path__)}
    assert not subpackages & set(kernels.__all__), subpackages & set(kernels.__all__)
    for folder in ("w8a16", "w8a8", "w8a8_multi"):
        for sub in ("reference", "triton"):
            try:
                importlib.import_module(f"epirl.kernels.{folder}.{sub}")
            except ImportError:  # triton missing: only the reference exists
                pass
    for name in ("w8a16_lora", "w8a8_lora", "w8a8_multi_lora"):
        assert callable(getattr(kernels, name)), name


def test_table_tma_values_are_checked_when_the_table_loads(tmp_path):
    """An entry's "tma" is true (x and the codes through descriptors, kernels/w8a16/ws_tma.py) or false: anything else
    is one line naming the entry; the committed table selects TMA somewhere."""
    import json

    from epirl.kernels.w8a16.configs import TMA_TABLE_PATH

    table = json.loads(TMA_TABLE_PATH.read_text())
    assert any(c.get("tma") for row in table["fwd"].values() for c in row.values())
    table["dx"]["default"]["1000000000"]["tma"] = "x"  # the x-only variant was removed
    path = tmp_path / "ws_tma.json"
    path.write_text(json.dumps(table))
    load_table.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"ws_tma\.json: dx\.default\.1000000000: tma must be true or false"):
            load_table(str(path))
        assert load_table() == json.loads(TMA_TABLE_PATH.read_text())
    finally:
        load_table.cache_clear()


def test_table_tma_calls_are_checked_against_the_pointer_kernel_per_key(monkeypatch):
    """`checked_tma_single`: a key's first call runs the pointer kernel and the TMA kernel twice; equal bits keep TMA
    for the key, a difference in either run warns, returns the pointer kernel's result and keeps the pointer kernel
    for the key. A verified key is compared again every RECHECK_EVERY calls, and moves to the pointer kernel the
    first time it differs."""
    import torch

    from epirl.kernels.w8a16 import ws_tma

    monkeypatch.setattr(ws_tma, "_CHECKED", {})
    monkeypatch.setattr(ws_tma, "_CALLS", {})
    calls = []
    want = torch.arange(12.0).reshape(3, 4)

    def pointer(out):
        calls.append("ptr")
        return out.copy_(want)

    def good_tma(out):
        calls.append("tma")
        return out.copy_(want)

    def bad_tma(out):
        calls.append("tma")
        return out.copy_(want).index_fill_(1, torch.tensor([2]), 7.0)

    zeros = lambda out: out.zero_()  # noqa: E731
    ws_tma.checked_tma_single(("zeros",), torch.empty(2, 2), zeros, zeros)
    assert ("zeros",) not in ws_tma._CHECKED  # an all-zero output verifies nothing: the next call is checked again
    nan = torch.full((2, 2), float("nan"))  # bitwise compare: NaN outputs at the same places are the same bits
    ws_tma.checked_tma_single(("nan",), torch.empty(2, 2), lambda out: out.copy_(nan), lambda out: out.copy_(nan))
    assert ws_tma._CHECKED[("nan",)] is True
    y = ws_tma.checked_tma_single(("good",), torch.empty(3, 4), good_tma, pointer)
    assert torch.equal(y, want) and calls == ["ptr", "tma", "tma"]
    ws_tma.checked_tma_single(("good",), torch.empty(3, 4), good_tma, pointer)
    assert calls == ["ptr", "tma", "tma", "tma"]  # checked once: TMA alone from then on
    calls.clear()
    with pytest.warns(UserWarning, match=r"3 of 12 elements differ from the pointer kernel"):
        y = ws_tma.checked_tma_single(("bad",), torch.empty(3, 4), bad_tma, pointer)
    assert torch.equal(y, want)
    y = ws_tma.checked_tma_single(("bad",), torch.empty(3, 4), bad_tma, pointer)
    assert torch.equal(y, want) and calls == ["ptr", "tma", "tma", "ptr"]
    flaky = iter([False, True])  # right on one of its two runs: still refused
    with pytest.warns(UserWarning, match=r"differ from the pointer kernel"):
        ws_tma.checked_tma_single(("flaky",), torch.empty(3, 4),
                                  lambda out: (bad_tma if next(flaky) else good_tma)(out), pointer)
    assert ws_tma._CHECKED[("flaky",)] is False

    monkeypatch.setattr(ws_tma, "RECHECK_EVERY", 3)
    calls.clear()
    late = iter([False] * 5 + [True] * 5)  # right on the first check and the first recheck, then wrong
    run_late = lambda out: (bad_tma if next(late) else good_tma)(out)  # noqa: E731
    for _ in range(5):
        y = ws_tma.checked_tma_single(("late",), torch.empty(3, 4), run_late, pointer)
    assert calls == ["ptr", "tma", "tma", "tma", "ptr", "tma", "tma", "tma"]  # calls 1 and 3 checked
    assert ws_tma._CHECKED[("late",)] is True
    with pytest.warns(UserWarning, match=r"differ from the pointer kernel at call 6, after passing at call 3"):
        y = ws_tma.checked_tma_single(("late",), torch.empty(3, 4), run_late, pointer)
    assert torch.equal(y, want) and ws_tma._CHECKED[("late",)] is False
    calls.clear()
    ws_tma.checked_tma_single(("late",), torch.empty(3, 4), run_late, pointer)
    assert calls == ["ptr"]


def test_host_integer_helpers_match_triton():
    # kernels/_host.py replaces triton.cdiv / triton.next_power_of_2 (constexpr functions, slow from host code) in
    # every launch path: same values
    triton = pytest.importorskip("triton")
    from epirl.kernels._host import cdiv, next_power_of_2
    for n in [0, 1, 2, 3, 15, 16, 17, 63, 64, 65, 1000, 4096, 12288, 2 ** 31 + 5]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 16, 64, 128, 256, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


@pytest.mark.parametrize("op,gluon,ok", [
    ("fwd", {"BM": 256, "BK": 64, "num_stages": 4}, True),
    ("fwd", {"BM": 128, "BK": 128, "num_stages": 3, "GROUP_N": 4}, True),
    ("fwd", {"BM": 192, "BK": 64, "num_stages": 4}, False),  # not a power of two: Gluon's block shapes
    ("fwd", {"BM": 256, "BK": 64}, False),                    # no ring depth
    ("fwd", {"BM": 256, "BK": 64, "num_stages": 4, "warps": 8}, False),
    ("fwd", {"BM": 256, "BK": 64, "num_stages": 4, "GROUP_N": 0}, False),
    ("dx", {"BM": 256, "BK": 64, "num_stages": 4}, True),     # dX: the codes read transposed
    ("dx", {"BM": 64, "BK": 64, "num_stages": 4}, False),
    ("dx", {"BM": 128, "BK": 64, "num_stages": 4, "LORA_RING": True}, True),
    ("fwd", {"BM": 128, "BK": 64, "num_stages": 4, "LORA_RING": "yes"}, False),
    ("fwd", {"BM": 128, "BK": 64, "num_stages": 4, "A_SMEM": True}, False),  # the removed shared-memory widening
])
def test_table_gluon_entries_are_checked_when_the_table_loads(tmp_path, op, gluon, ok):
    """A table entry's "gluon" (the warp-specialized forward or dX, kernels/w8a16/ws_gluon.py) is validated with the
    table: a bad one is one line naming the entry, before any kernel runs; the committed table's pass."""
    import json

    from epirl.kernels.w8a16.configs import TMA_TABLE_PATH

    table = json.loads(TMA_TABLE_PATH.read_text())
    assert any("gluon" in c for row in table["fwd"].values() for c in row.values())
    table[op]["default"]["1000000000"]["gluon"] = gluon
    path = tmp_path / "ws_gluon.json"
    path.write_text(json.dumps(table))
    load_table.cache_clear()
    try:
        if ok:
            assert load_table(str(path))[op]["default"]["1000000000"]["gluon"] == gluon
        else:
            with pytest.raises(RuntimeError, match=rf"ws_gluon\.json: {op}\.default\.1000000000\.gluon: "):
                load_table(str(path))
    finally:
        load_table.cache_clear()
