"""The wgmma drain (kernels/w8a16/wgmma_drain.py): the PTX pass, when it runs, and that it reaches Triton's cache key.

CI's Triton (3.9) does not need the pass; the tests that compile force it on in a subprocess (the setting is read at
import) and check the real kernels' PTX and SASS, which is what Triton 3.6 gets by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from epirl.kernels.w8a16 import wgmma_drain

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOOP_PTX = """\
.visible .entry _ws_tma_kernel(
{
$L__BB0_1:
\tld.shared.b16 %rs1, [%r1];
\twgmma.fence.sync.aligned;
\twgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%r10}, {%r1,%r2,%r3,%r4}, %rd1, %p5, 1, 1, 0;
\twgmma.commit_group.sync.aligned;
\twgmma.wait_group.sync.aligned 3;
\twgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%r10}, {%r5,%r6,%r7,%r8}, %rd2, %p5, 1, 1, 0;
\twgmma.commit_group.sync.aligned;
\twgmma.wait_group.sync.aligned 3;
\t@%p1 bra $L__BB0_1;
\t@%p2 bra $L__BB0_3;
$L__BB0_2:
\tadd.s32 %r1, %r1, 1;
\twgmma.wait_group.sync.aligned 2;
\t@%p3 bra $L__BB0_2;
$L__BB0_3:
\twgmma.wait_group.sync.aligned 1;
\tret;
}"""


def test_drain_zeroes_only_the_last_wait_of_each_wgmma_loop():
    drained, changed = wgmma_drain.drain_loop_ends(LOOP_PTX)
    assert changed == 1
    lines = drained.split("\n")
    waits = [line.strip() for line in lines if "wait_group" in line]
    # in the wgmma loop: the first wait keeps its count (k-steps of one trip overlap), the last one drains; a loop
    # without a wgmma and the wait after a forward branch are left alone
    assert waits == ["wgmma.wait_group.sync.aligned 3;", "wgmma.wait_group.sync.aligned 0;",
                     "wgmma.wait_group.sync.aligned 2;", "wgmma.wait_group.sync.aligned 1;"]
    assert [a for a, b in zip(lines, LOOP_PTX.split("\n")) if a != b] == ["\twgmma.wait_group.sync.aligned 0;"]
    assert wgmma_drain.drain_loop_ends(drained) == (drained, 0)  # idempotent


def test_drain_runs_only_on_tritons_with_the_race():
    assert wgmma_drain.drain_wanted((3, 6)) and wgmma_drain.drain_wanted((3, 7))
    assert not wgmma_drain.drain_wanted((3, 9)) and not wgmma_drain.drain_wanted((4, 0))


def _in_subprocess(code: str, drain: str) -> dict:
    """code run in a fresh process whose Triton reports a version with the race (drain "1": the pass on) or without it
    ("0": off), whatever Triton is installed."""
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "scripts"))
    env.pop("TRITON_INTERPRET", None)
    code = textwrap.dedent(code)
    version = "3.6.0" if drain == "1" else "3.9.0"
    code = f"import triton\ntriton.__version__ = {version!r}\n" + code
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_drain_setting_enters_the_w8a16_kernels_cache_keys():
    code = """
        import json
        from epirl.kernels.w8a16 import wgmma_drain, weight_stationary as ws, ws_tma, ws_splitk
        kernels = [ws._ws_single_kernel, ws._ws_partial_kernel, ws_tma._ws_tma_kernel, ws_splitk._ws_ticket_kernel]
        print(json.dumps(dict(drain=bool(wgmma_drain.DRAIN), keys=[k.cache_key for k in kernels],
                              names=[k.__name__ for k in kernels])))
    """
    off, on, on_again = (_in_subprocess(code, d) for d in ("0", "1", "1"))
    assert (off["drain"], on["drain"]) == (False, True)
    assert sorted(on["names"]) == sorted(wgmma_drain.KERNELS)  # the pass covers exactly these kernels
    assert all(a != b for a, b in zip(off["keys"], on["keys"]))  # no binary is reused across the setting
    assert on["keys"] == on_again["keys"]


def test_forced_drain_leaves_no_write_to_an_in_flight_operand():
    """The many-token forward tile and the TMA kernel, compiled through the installed pass: their K loops end in
    `wait_group 0`, the SASS has no write into a pending wgmma's A registers, and ptxas keeps the wgmmas in flight
    within a trip (not serialized)."""
    code = """
        import json, re
        import triton
        import sass_report
        from epirl.kernels.w8a16 import wgmma_drain
        name, build = next((n, b) for n, b in sass_report.wgmma_cases() if n.startswith("w8a16 fwd default M<=1000"))
        ptx = build()
        tma = sass_report.compile_tma("128/256/64/8/4")
        notes = sass_report.ptxas_notes(ptx)
        installed = triton.knobs.runtime.add_stages_inspection_hook is wgmma_drain._STATE.get("hook")
        print(json.dumps(dict(installed=installed, notes=notes,
                              tma_races=len(sass_report.wgmma_register_hazards(tma.asm["cubin"])),
                              undrained=[wgmma_drain.drain_loop_ends(p)[1] for p in (ptx, tma.asm["ptx"])])))
    """
    if not os.path.exists(os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin",
                                       "cuobjdump")):
        pytest.skip("this triton ships no ptxas/cuobjdump")
    got = _in_subprocess(code, "1")
    assert got["installed"]
    assert got["undrained"] == [0, 0]  # the pass already ended every wgmma loop with wait 0
    assert got["notes"]["operand_races"] == 0 and got["tma_races"] == 0, got
    assert got["notes"]["serialized"] == "", got


def test_install_chains_other_hooks_and_comes_back_after_a_replacement(monkeypatch):
    """With the pass on: a hook set before it still runs (and keys the cache); one that replaces it later is chained
    behind it again on the next W8A16 call (`install`), so the pass cannot be dropped while the binaries are keyed as
    drained; the pass edits only the W8A16 kernels' PTX."""
    import triton

    runtime = triton.knobs.runtime
    monkeypatch.setattr(wgmma_drain, "DRAIN", True)
    monkeypatch.setattr(wgmma_drain, "_STATE", {})
    seen = []

    def other(*args, **kwargs):
        if not args:
            return "other-key", "other-hash"
        seen.append(sorted(next(a for a in args if isinstance(a, dict))))

    monkeypatch.setattr(runtime, "add_stages_inspection_hook", None)
    assert wgmma_drain.install() and runtime.add_stages_inspection_hook is wgmma_drain._STATE["hook"]  # on its own
    assert runtime.add_stages_inspection_hook() == ("" + wgmma_drain.PASS_KEY, "" + wgmma_drain.PASS_KEY)
    monkeypatch.setattr(wgmma_drain, "_STATE", {})
    monkeypatch.setattr(runtime, "add_stages_inspection_hook", other)
    assert wgmma_drain.install() and runtime.add_stages_inspection_hook is not other
    assert runtime.add_stages_inspection_hook() == ("other-key" + wgmma_drain.PASS_KEY,
                                                    "other-hash" + wgmma_drain.PASS_KEY)

    def run_stages(entry: str) -> str:
        stages = {"ptx": lambda src, metadata: LOOP_PTX.replace("_ws_tma_kernel", entry)}
        runtime.add_stages_inspection_hook(None, stages, None, None, 90)
        return stages["ptx"](None, {})
    assert "wait_group.sync.aligned 0;" in run_stages("_ws_tma_kernel") and seen == [["ptx"]]
    assert run_stages("someone_elses_kernel") == LOOP_PTX.replace("_ws_tma_kernel", "someone_elses_kernel")

    monkeypatch.setattr(runtime, "add_stages_inspection_hook", other)  # a library replaces the hook
    assert wgmma_drain.install() and runtime.add_stages_inspection_hook is wgmma_drain._STATE["hook"]
    assert "wait_group.sync.aligned 0;" in run_stages("_ws_single_kernel")
    assert wgmma_drain.install() and runtime.add_stages_inspection_hook is wgmma_drain._STATE["hook"]  # no re-wrap
