"""Drain the W8A16 kernels' wgmma pipeline at the end of each K-loop trip on Tritons with the register-A race.

Why: the W8A16 kernels widen e4m3 codes in registers and feed them to wgmma as its register-sourced A operand.
A wgmma reads that operand asynchronously, until a `wgmma.wait_group` retires it. Triton before the fix of
triton-lang/triton#9433 (PR #9514, in 3.9; 3.6 and 3.7.1 lack it) pipelines k-steps so that the next trip of the
K loop writes the A registers of up to `pendings` wgmmas of the trip before while they are still in flight: a race
with the tensor core. Measured on an H200 (scripts/race_count.py): under Triton 3.6 the TMA forward
gave wrong tiles (|diff| up to 5e29 × max |y|) in 11 of 16,000 calls, with this pass in 0 of 12,000; under 3.9, 0 of
16,000. The SASS check
(`scripts/sass_report.py --wgmma`, operand-races column) finds 12-86 such writes per loop in every W8A16 Triton
kernel that Triton 3.6 builds, and 0 in what 3.9 builds.

How: a PTX pass, run through Triton's `knobs.runtime.add_stages_inspection_hook` on the PTX of the kernels in
`KERNELS` only: in every loop whose body issues a wgmma, the last `wgmma.wait_group N` before the backward branch
becomes `wgmma.wait_group 0`. Then no wgmma is in flight when the next trip starts writing registers (all writes of
the next trip's A fragments come before its first wgmma), and the k-steps inside one trip still overlap. Renaming the
operands with `mov`s (the upstream fix) does not help under Triton 3.6's ptxas 12.8: it propagates the copies and
still reuses the registers (0 such writes only with ptxas 13.4). Synchronization only: the bits of every result are the
same with and without the pass.

`DRAIN` (a constexpr global that `widen.widen_e4m3`, called by every such kernel, reads) puts the setting into
every affected kernel's Triton cache key, so a binary built with the pass is never reused without it, or the reverse.
"""

from __future__ import annotations

import re
import warnings

import triton
import triton.language as tl

# the Triton kernels that feed widened codes to a register-A wgmma (the Gluon forward synchronizes itself)
KERNELS = ("_ws_single_kernel", "_ws_tma_kernel", "_ws_partial_kernel", "_ws_ticket_kernel")
FIXED_IN = (3, 9)  # first Triton release measured free of the race (SASS and H200)
PASS_KEY = "epirl-wgmma-drain-1"  # bump when drain_loop_ends changes what it writes


def _triton_version() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", triton.__version__).groups()
    return int(major), int(minor)


def drain_wanted(version: tuple[int, int] | None = None) -> bool:
    """Whether the pass runs in this process: on a Triton older than the first release without the race."""
    return (version or _triton_version()) < FIXED_IN


DRAIN = tl.constexpr(drain_wanted())

_LABEL = re.compile(r"^\s*(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")
_WAIT = re.compile(r"(wgmma\.wait_group\.sync\.aligned)\s+\d+;")


def drain_loop_ends(ptx: str) -> tuple[str, int]:
    """`ptx` with the last `wgmma.wait_group` of every wgmma loop (a backward branch to a label above it whose body
    issues `wgmma.mma_async`) set to 0, and how many waits it changed."""
    lines = ptx.split("\n")
    labels: dict[str, int] = {}
    changed = 0
    for i, line in enumerate(lines):
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = i
            continue
        branch = _BRANCH.search(line)
        start = labels.get(branch.group(1)) if branch else None
        if start is None:  # not a branch, or a forward one
            continue
        body = range(start + 1, i)
        waits = [j for j in body if _WAIT.search(lines[j])]
        if waits and any("wgmma.mma_async" in lines[j] for j in body):
            last = waits[-1]
            drained = _WAIT.sub(r"\1 0;", lines[last])
            changed += drained != lines[last]
            lines[last] = drained
    return "\n".join(lines), changed


def _entry_name(ptx: str) -> str | None:
    m = re.search(r"\.entry\s+([A-Za-z_]\w*)", ptx)
    return m.group(1) if m else None


def _wrap_ptx_stage(make_ptx):
    def make_ptx_drained(src, metadata):
        ptx = make_ptx(src, metadata)
        return drain_loop_ends(ptx)[0] if _entry_name(ptx) in KERNELS else ptx
    return make_ptx_drained


_STATE: dict = {}  # "hook": the hook this module set last; "warned": Triton has no stages hook (told once)


def install() -> bool:
    """Put the pass into Triton's compile pipeline when `DRAIN` is on, chained after whatever hook is set; again if
    something replaced the hook since (the W8A16 entry points call this before they launch, so a library that sets
    its own hook later cannot silently drop the pass: the binaries would still be keyed as drained). Whether the pass
    is in place."""
    if not DRAIN:
        return False
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "add_stages_inspection_hook"):
        if not _STATE.get("warned"):
            _STATE["warned"] = True
            warnings.warn(f"Triton {triton.__version__} has no add_stages_inspection_hook: the W8A16 Triton kernels "
                          f"keep its register-A wgmma race (triton-lang/triton#9433); use Triton >= 3.9")
        return False
    if "hook" in _STATE and runtime.add_stages_inspection_hook is _STATE["hook"]:
        return True
    previous = runtime.add_stages_inspection_hook

    def hook(*args, **kwargs):
        if not args and not kwargs:
            # Triton >= 3.7 also calls it bare, per compile and per launch, for a (key, hash) pair that it adds to
            # the cache key (3.6 does not: there `DRAIN` in widen_e4m3's globals keys the binaries)
            key, digest = previous() if previous is not None else ("", "")
            return key + PASS_KEY, digest + PASS_KEY
        # backend.add_stages calls hook(backend, stages, options, language, capability): edit the stages dict (the
        # pass is idempotent, so a chain that runs it twice changes nothing)
        if previous is not None:
            previous(*args, **kwargs)
        stages = next(a for a in args if isinstance(a, dict))
        if "ptx" in stages:
            stages["ptx"] = _wrap_ptx_stage(stages["ptx"])

    runtime.add_stages_inspection_hook = hook
    _STATE["hook"] = hook
    return True
