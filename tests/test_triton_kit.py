"""The Triton 3.7.1 + fla kit (scripts/offline/triton_kit.sh) and its device check (gpu_fla_check.py), on CPU:
shell syntax, the trim list, the call planner, the device installer on a fake payload (sums, idempotence,
refusal of a corrupt part), and the check script's table / failure aggregation with stub checks. What needs the
H200 (the real payload, fla, vLLM) is gpu_fla_check.py's job there."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = ROOT / "scripts" / "offline"
KIT = OFFLINE / "triton_kit.sh"
CHECK = OFFLINE / "gpu_fla_check.py"


def kit(*args: str, stage: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env, **({"STAGE": str(stage)} if stage else {})}
    return subprocess.run(["bash", str(KIT), *args], capture_output=True, text=True, env=full_env, cwd=ROOT,
                          timeout=60)


@pytest.mark.parametrize("script", sorted(p.name for p in OFFLINE.glob("*.sh")))
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(OFFLINE / script)], check=True)


def test_trim_list_gives_a_reason_for_each_path_and_keeps_what_sm90_needs():
    lines = kit("--print-trim").stdout.strip().splitlines()
    paths = []
    for line in lines:
        path, sep, why = line.partition("  # ")
        assert sep and len(why) > 20 and " " not in path, line
        paths.append(path)
    assert len(set(paths)) == len(paths) >= 6
    needed = ["triton/_C/libtriton.so", "triton/backends/nvidia/bin/ptxas", "triton/backends/nvidia/bin/nvdisasm",
              "triton/backends/nvidia/bin/cuobjdump", "triton/backends/nvidia/lib/libdevice.10.bc",
              "triton/backends/nvidia/include", "triton/backends/amd", "triton/__init__.py", "fla"]
    for keep in needed:  # neither trimmed itself nor inside a trimmed folder
        assert not any(keep == p or keep.startswith(p + "/") for p in paths), keep


def fake_stage(stage: Path, sizes_mib: dict[str, float]) -> None:
    stage.mkdir(parents=True, exist_ok=True)
    for name, mib in sizes_mib.items():
        with open(stage / name, "wb") as f:  # sparse: only the size matters to the planner
            f.truncate(int(mib * 2**20))
    for small in ("SHA256SUMS", "install.sh", "env.sh", "SHA256SUMS-triton37"):
        (stage / small).write_text("#\n")


def parse_plan(out: str) -> list[tuple[float, list[str], str]]:
    calls = re.findall(r"call \d+ \(([\d.]+) MiB\): carry=\[(.*?)\]\n  command: (.*)", out)
    return [(float(size), re.findall(r'"\.stage/([^"]+)"', carry), cmd) for size, carry, cmd in calls]


def test_plan_packs_every_part_once_within_the_carry_limit_and_installs_last(tmp_path):
    stage = tmp_path / ".stage"
    fake_stage(stage, {"vllm26.part00": 58, "vllm26.part01": 58, "vllm26.part02": 49.8,
                       "triton37.part00": 40, "triton37.part01": 9})
    kit("--device-scripts", stage=stage)
    res = kit("--plan", stage=stage, CARRY_MB="60")
    assert res.returncode == 0, res.stderr
    calls = parse_plan(res.stdout)
    parts = [p for _, carried, _ in calls for p in carried if ".part" in p]
    assert sorted(parts) == sorted(f.name for f in stage.glob("*.part*"))  # each exactly once
    assert all(size <= 60 for size, _, _ in calls) and len(calls) == 4  # 215 MiB: 4 calls is the minimum
    *early, (_, last_carry, last_cmd) = calls
    assert {"SHA256SUMS-triton37", "install-triton37.sh", "env-triton37.sh", "install.sh"} <= set(last_carry)
    assert last_cmd.index("bash .stage/install.sh") < last_cmd.index("bash .stage/install-triton37.sh") \
        < last_cmd.index("source ~/env-triton37.sh")  # the kit's PYTHONPATH entry goes in front of vLLM's
    for _, carried, cmd in early:  # earlier calls only park their parts in $HOME/stage
        assert "install" not in cmd and all(f".stage/{p}" in cmd for p in carried)


def test_plan_without_parts_says_so(tmp_path):
    res = kit("--plan", stage=tmp_path / "empty")
    assert res.returncode != 0 and "no .partNN" in res.stdout + res.stderr


def make_payload(stage: Path, tmp_path: Path) -> None:
    """A tiny stand-in for the site tree, packed as the build packs it (tar | xz, split, sha256sum)."""
    tree = tmp_path / "tree" / "triton"
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("__version__ = '3.7.1'\n")
    (tree / "blob.bin").write_bytes(os.urandom(300_000))  # incompressible: gives two parts at CHUNK 200 kB
    subprocess.run(f"tar -C {tmp_path / 'tree'} -cf - . | xz -1 > {tmp_path / 'p.tar.xz'} && "
                   f"split -b 200000 -d -a 2 {tmp_path / 'p.tar.xz'} {stage / 'triton37.part'} && "
                   f"cd {stage} && sha256sum triton37.part* > SHA256SUMS-triton37", shell=True, check=True)


def device_call(repo: Path, home: Path, cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=repo, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HOME": str(home), "PYTHONPATH": "/x"})


def staged_repo(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(repo, home, repo/.stage) with the device scripts and a two-part fake payload staged."""
    repo, home = tmp_path / "repo", tmp_path / "home"
    stage = repo / ".stage"
    stage.mkdir(parents=True)
    home.mkdir()
    kit("--device-scripts", stage=stage)
    make_payload(stage, tmp_path)
    return repo, home, stage


def test_device_installer_checks_sums_unpacks_once_and_env_shadows(tmp_path):
    repo, home, stage = staged_repo(tmp_path)
    parts = sorted(stage.glob("triton37.part*"))
    assert len(parts) == 2
    # call 1 carries part00 only; the repo copy of the next call no longer has it (ignored files do not stay)
    assert device_call(repo, home, "mkdir -p $HOME/stage && cp .stage/triton37.part00 $HOME/stage/").returncode == 0
    parts[0].unlink()
    first = device_call(repo, home, "bash .stage/install-triton37.sh && source ~/env-triton37.sh && "
                                    "echo PP=$PYTHONPATH TC=$TRITON_CACHE_DIR")
    assert first.returncode == 0, first.stderr
    assert "unpacked to" in first.stdout and (home / "triton37-site" / "triton" / "__init__.py").exists()
    assert f"PP={home}/triton37-site:/x" in first.stdout and f"TC={home}/.cache/triton37" in first.stdout
    again = device_call(repo, home, "bash .stage/install-triton37.sh && source ~/env-triton37.sh && "
                                    "source ~/env-triton37.sh && echo PP=$PYTHONPATH")
    assert again.returncode == 0 and "unpacked" not in again.stdout  # idempotent: no second unpack
    assert f"PP={home}/triton37-site:/x\n" in again.stdout  # sourcing twice does not stack entries


def test_device_installer_refuses_a_corrupt_part(tmp_path):
    repo, home, stage = staged_repo(tmp_path)
    with open(stage / "triton37.part01", "r+b") as f:
        f.write(b"\0garbage")
    res = device_call(repo, home, "bash .stage/install-triton37.sh")
    assert res.returncode != 0 and not (home / "triton37-site").exists()


# ---- scripts/offline/gpu_fla_check.py ----------------------------------------------------------------------------

def load_check():
    spec = importlib.util.spec_from_file_location("gpu_fla_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_fla_check"] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_check_script_imports_nothing_cuda_at_import_time():
    code = (f"import sys, importlib.util as u; s = u.spec_from_file_location('c', {str(CHECK)!r}); "
            "m = u.module_from_spec(s); sys.modules['c'] = m; s.loader.exec_module(m); "
            "bad = [n for n in ('torch', 'triton', 'fla', 'vllm', 'transformers', 'epirl') if n in sys.modules]; "
            "print(bad); sys.exit(bool(bad))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_failures_are_aggregated_and_never_shown_as_passed(capsys):
    m = load_check()

    def boom():
        raise RuntimeError("kernel exploded\nsecond line")

    def wrong():
        assert 1 == 2, "rel 3e-1 > 1e-2"

    def skipped():
        raise m.Skip("vllm not importable")

    checks = [m.Check("good", lambda: "fine | detail"), m.Check("raises", boom), m.Check("asserts", wrong),
              m.Check("skipped", skipped), m.Check("optional", boom, required=False)]
    results = m.run_checks(checks)
    assert [r.status for r in results] == ["ok", "FAIL", "FAIL", "skip", "FAIL"]
    table = m.format_table(results)
    lines = table.splitlines()
    assert lines[0].startswith("| check | result") and len(lines) == 2 + len(checks)
    assert "| raises | FAIL |" in table and "RuntimeError: kernel exploded |" in table  # first line only
    assert "AssertionError: rel 3e-1 > 1e-2" in table and "| skipped | skip |" in table
    assert "| optional | FAIL (optional) |" in table and "fine / detail" in table  # no broken columns
    assert m.exit_code(results) == 1
    assert m.exit_code([r for r in results if r.name in ("good", "skipped", "optional")]) == 0


def test_main_prints_one_table_and_exits_nonzero_on_a_required_failure(monkeypatch, capsys):
    m = load_check()
    seen = {}

    def fake_build(args):
        seen["skip_vllm"] = args.skip_vllm
        return [m.Check("versions / paths", lambda: "triton 3.7.1"),
                m.Check("vLLM", lambda: m.check_vllm(args.skip_vllm))]

    monkeypatch.setattr(m, "build_checks", fake_build)
    assert m.main(["--skip-vllm"]) == 0 and seen["skip_vllm"] is True
    out = capsys.readouterr().out
    assert "| vLLM | skip |" in out and "--skip-vllm" in out and out.count("| check |") == 1
    monkeypatch.setattr(m, "build_checks", lambda args: [m.Check("fla", lambda: m.check_versions("9.9.9"))])
    assert m.main([]) == 1  # here: no CUDA/fla, or the wrong triton -- either way a required FAIL, exit 1
    assert "| fla | FAIL |" in capsys.readouterr().out


def test_tiny_vllm_config_is_the_shipped_qwen35_shrunk(tmp_path):
    import json

    m = load_check()
    cfg = json.loads((m._tiny_vllm_qwen35(tmp_path) / "config.json").read_text())
    text = cfg["text_config"]
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in cfg
    assert text["num_hidden_layers"] == len(text["layer_types"]) == 4 and text["layer_types"][-1] == "full_attention"
    assert text["linear_key_head_dim"] == 128 and text["head_dim"] == 256  # the kernels' real head sizes
