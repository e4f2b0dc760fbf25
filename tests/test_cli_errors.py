"""Bad input to `epirl train`, `eval` and `mismatch`: exit code 2, exactly one line naming the flag or file, no
traceback, and nothing left behind, all before any engine starts. Also what the commands show: `--help` with
every default and the columns of local files, the end-of-run summary with every entry of the run folder, and
an install without setuptools' license deprecation warning.

The commands run in this process (`cli_helpers.run_cli`) from an empty working folder, with their input files
in a folder beside it.
"""

import io
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from rich.console import Console

from cli_helpers import run_cli
from epirl.config import ConfigError, load_config
from epirl.progress import RunProgress

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "smollm2_arith_cpu.yaml")


@pytest.fixture
def inputs(tmp_path):
    """Bad input files, in a folder beside the (empty) working folder."""
    folder = tmp_path / "inputs"
    folder.mkdir()
    (folder / "empty.yaml").write_text("# nothing but a comment\n")
    (folder / "list.yaml").write_text("- model\n- rl\n")
    (folder / "scalar.yaml").write_text("42\n")
    (folder / "broken.yaml").write_text("rl: {steps: 2\n")
    (folder / "recipe_dir").mkdir()
    (folder / "no_run").mkdir()
    (folder / "a_file").write_text("x")
    (folder / "minerva.jsonl").write_text(json.dumps({"question": "q", "solution": "s"}) + "\n")
    (folder / "bad_adapter").mkdir()
    (folder / "bad_adapter" / "adapter_config.json").write_text("{not json")
    return folder


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")

BAD_INPUTS = [
    # epirl train (--print-config: these recipes must fail while loading, before any other flag acts)
    (["train", "{in}/empty.yaml", "--print-config"],
     "error: recipe {in}/empty.yaml is empty; a recipe is a mapping of sections (model:, data:, rl:, ...)"),
    (["train", "{in}/list.yaml", "--print-config"],
     "error: recipe {in}/list.yaml: the top level is a list, not a mapping of sections (model:, data:, rl:, ...)"),
    (["train", "{in}/scalar.yaml", "--print-config"], "error: recipe {in}/scalar.yaml: the top level is the single "
                                                      "value 42, not a mapping of sections (model:, data:, rl:, ...)"),
    (["train", "{in}/recipe_dir"], "error: recipe {in}/recipe_dir is a folder; give a YAML file (see recipes/)"),
    (["train", "{in}/broken.yaml"], "error: {in}/broken.yaml: line 2 is not valid YAML"),
    (["train", "{in}/missing.yaml"], "error: recipe file not found: {in}/missing.yaml"),
    (["train", RECIPE, "rl.steps"], "error: override 'rl.steps' is not of the form key.sub=value"),
    (["train", RECIPE, "rl..steps=3"], "error: override 'rl..steps=3' has an empty key"),
    (["train", RECIPE, "rl.steps=abc"],
     "error: override rl.steps=abc: Input should be a valid integer, unable to parse string as an integer"),
    (["train", RECIPE, "--nproc", "0"],
     "error: --nproc 0: must be at least 1 and, inside a torchrun job, its rank count 1"),
    (["train", RECIPE, "--benchmark", "0"], "error: --benchmark N needs N >= 1 and no --resume"),
    (["train", RECIPE, "--no-such-flag"],
     "error: epirl train: unrecognized arguments: --no-such-flag (see epirl train --help)"),
    (["train", RECIPE, "--log-level", "LOUD"], "error: epirl train: argument --log-level: invalid choice: 'LOUD' "
                                               "(choose from 'DEBUG', 'INFO', 'WARNING', 'ERROR') (see epirl train --help)"),
    (["train", "--resume", "{in}/no_run"], "error: --resume {in}/no_run: not a run folder (no config.yaml in it)"),
    # epirl eval
    (["eval", "--model", "smollm2", "--adapter", "{in}/no_adapter"], "error: --adapter: folder not found: {in}/no_adapter"),
    (["eval", "--model", "smollm2", "--adapter", "{in}/bad_adapter"],
     "error: --adapter: {in}/bad_adapter/adapter_config.json has no integer 'r' (LoRA rank)"),
    (["eval", "--model", "smollm2", "--max-tokens", "abc"],
     "error: epirl eval: argument --max-tokens: invalid int value: 'abc' (see epirl eval --help)"),
    (["eval", "--model", "smollm2", "--max-tokens", "0"], "error: --max-tokens must be >= 1, got 0"),
    (["eval", "--model", "smollm2", "--benchmarks", "gsm8k"],
     "error: --benchmarks: unknown benchmark 'gsm8k' (known: olympiadbench, minerva, math500, arithmetic)"),
    (["eval", "--model", "smollm2", "--benchmarks", "minerva={in}/minerva.jsonl"],
     "error: --benchmarks: minerva: {in}/minerva.jsonl lacks column(s) answer (has question, solution)"),
    (["eval", "--model", "smollm2", "--benchmarks", "arithmetic={in}/minerva.jsonl"],
     "error: --benchmarks: benchmark 'arithmetic' is generated (the training task) and takes no file"),
    (["eval", "--model", "./no/model/here"],
     "error: --model: './no/model/here' is not a folder, a hub id (org/name) or an alias ('smollm2',)"),
    (["eval", "--benchmarks", "arithmetic"],
     "error: epirl eval: the following arguments are required: --model (see epirl eval --help)"),
    (["eval", "--model", "smollm2", "--benchmarks", "arithmetic", "--out", "{in}/a_file"],
     "error: --out {in}/a_file: is a file, not a folder"),
    (["eval", "--model", "smollm2", "--benchmarks", "arithmetic", "--samples", "4"],
     "error: --samples 4 needs --temperature > 0 (greedy decoding repeats itself)"),
    # epirl mismatch
    (["mismatch", "--engines", "fp4"],
     "error: --engines: unknown engine precision(s) ['fp4']; choose from bf16,w8a8,w8a16,w8a8@fused,w8a8@timed,w8a16-bitwise"),
    (["mismatch", "--engines", "w8a16-bitwise", "model.dtype=float32"],
     "error: --engines w8a16-bitwise: needs model.dtype=bfloat16 (the run resolves to float32); add the override "
     "model.dtype=bfloat16"),
    (["mismatch", "--n-prompts", "0"], "error: --n-prompts must be ≥ 1, got 0"),
    (["mismatch", "--temperature", "0"],
     "error: --temperature must be > 0 (log-probs of sampled tokens), got 0.0"),
    (["mismatch", "--topk", "50"], "error: --topk must be in 1..20 (vLLM's max_logprobs), got 50"),
    (["mismatch", "model.dtype"], "error: override 'model.dtype' is not of the form key.sub=value"),
    (["mismatch", "--adapter", "{in}/no_adapter"], "error: --adapter: folder not found: {in}/no_adapter"),
    (["mismatch", "--model", "./no/model/here"],
     "error: --model ./no/model/here: no such folder (a hub id is spelled org/name)"),
    (["mismatch", "--prompts", "{in}/missing.jsonl"], "error: --prompts: no such file: {in}/missing.jsonl"),
    (["mismatch", "--out", "{in}/a_file"], "error: --out {in}/a_file: is a file, not a folder"),
    pytest.param(["mismatch", "trainer.device=cuda"], "error: trainer.device=cuda but CUDA is not available",
                 marks=NO_CUDA),
]


@pytest.mark.parametrize("argv, expected", BAD_INPUTS, ids=lambda value: " ".join(value)[:60]
                         if isinstance(value, list) else "")
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(argv, expected, inputs, workdir, capfd):
    before = sorted(p.relative_to(inputs) for p in inputs.rglob("*"))
    code, lines = run_cli([item.replace("{in}", str(inputs)) for item in argv], capfd)
    assert code == 2, lines
    assert lines == [expected.replace("{in}", str(inputs))]
    assert not any("Traceback" in line for line in lines)
    assert os.listdir(workdir) == [], "bad input must leave nothing behind"
    assert sorted(p.relative_to(inputs) for p in inputs.rglob("*")) == before


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("# only a comment\n", "is empty"),
    ("[]\n", "the top level is a list"),
    ("- rl: {steps: 2}\n", "the top level is a list"),
    ("smollm2\n", "the top level is the single value 'smollm2'"),
    ("0\n", "the top level is the single value 0"),
])
def test_an_empty_or_non_mapping_recipe_is_an_error_not_a_default_run(tmp_path, text, message):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(recipe)
    assert str(error.value).startswith(f"recipe {recipe}") and message in str(error.value)


# ----------------------------------------------------------------------------------------- --help
def help_entries(argv, capfd, monkeypatch) -> tuple[dict[str, str], str]:
    """({option or positional: its help text, joined over lines}, the whole help)."""
    monkeypatch.setenv("COLUMNS", "160")
    code, lines = run_cli(argv, capfd)
    assert code == 0
    entries, current, in_arguments = {}, None, False
    for line in lines:
        if not line.startswith(" "):  # a section title, or the epilog
            in_arguments, current = line in ("options:", "positional arguments:"), None
        elif in_arguments and not line.startswith("   "):  # "  --flag VALUE   help ..."
            current = line.split()[0].rstrip(",")
            entries[current] = line.strip()
        elif in_arguments and current is not None:  # the help text continued
            entries[current] += " " + line.strip()
    return entries, "\n".join(lines)


@pytest.mark.parametrize("command, columns", [
    ("eval", ["olympiadbench: question, final_answer", "minerva: question, answer", "math500: problem, answer"]),
    ("mismatch", ["math: problem (or question), answer", "dapo: prompt (a string or chat messages), "
                                                         "reward_model.ground_truth"]),
    ("train", []),
])
def test_help_shows_every_default_and_the_columns_of_local_files(command, columns, capfd, monkeypatch):
    entries, text = help_entries([command, "--help"], capfd, monkeypatch)
    from epirl.cli import build_parser

    parser = build_parser()._subparsers._group_actions[0].choices[command]
    options = [action for action in parser._actions if action.dest != "help"]
    shown = {name: entry for name, entry in entries.items() if name != "-h"}
    assert len(shown) >= len(options) - 1, shown  # --thinking/--no-thinking is one entry
    for name, entry in shown.items():
        needs = "required" if name == "--model" and command == "eval" else "(default"
        assert needs in entry, f"{command} --help: {name} shows no default: {entry}"
    assert "(default: 2048)" in entries.get("--max-tokens", "") or command != "eval"
    assert "(default: 128)" in entries.get("--n-prompts", "") or command != "mismatch"
    assert "(default: INFO)" in entries.get("--log-level", "") or command != "train"
    for column_line in columns:
        assert column_line in text


# ----------------------------------------------------------------------------------------- run summary
def test_summary_lists_every_entry_of_the_run_folder(tmp_path):
    run = tmp_path / "run"
    for folder in ("adapter", "checkpoints", "wandb", "eval"):
        (run / folder).mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "reward.png", "samples.jsonl", "train.log"):
        (run / name).write_text("")
    output = io.StringIO()
    progress = RunProgress(Console(file=output, width=300), run, total_steps=2, plot=False)
    progress.print_summary(run)
    first = output.getvalue().splitlines()[0]
    assert first.endswith(f"{run} (adapter/, checkpoints/, config.yaml, eval/, metrics.jsonl, reward.png, "
                          "samples.jsonl, train.log, wandb/)"), first


# ----------------------------------------------------------------------------------------- packaging
def test_project_license_is_an_spdx_string_without_setuptools_deprecation():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in project["build-system"]["requires"]  # SPDX `license` needs setuptools 77
    assert "license" not in (REPO / "setup.py").read_text().lower()  # one place for the license: pyproject
    script = ("import warnings\n"
              "from setuptools.config.pyprojecttoml import apply_configuration\n"
              "from setuptools.dist import Distribution\n"
              "with warnings.catch_warnings(record=True) as caught:\n"
              "    warnings.simplefilter('always')\n"
              "    dist = apply_configuration(Distribution(), 'pyproject.toml')\n"
              "print([str(w.message).splitlines()[0] for w in caught if 'license' in str(w.message).lower()])\n"
              "print(dist.metadata.license_expression)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "Apache-2.0"], proc.stdout + proc.stderr


def test_a_bad_recipe_key_or_help_answers_without_importing_torch_or_vllm():
    """Reading and checking a recipe needs neither torch nor vLLM (seconds of import): `epirl train` with a bad
    override, `--print-config` and `train --help` answer from pydantic alone, in a fresh interpreter."""
    probe = ("import sys; from epirl.cli import main\n"
             "for argv in {argvs!r}:\n"
             "    try:\n"
             "        code = main(argv)\n"
             "    except SystemExit as exit:\n"
             "        code = exit.code\n"
             "    print('code', code, file=sys.stderr)\n"
             "print(sorted(name for name in ('torch', 'vllm', 'scipy', 'transformers') if name in sys.modules),"
             " file=sys.stderr)\n")
    argvs = [["train", RECIPE, "rl.clip_low=3"], ["train", RECIPE, "rl.stepz=3"], ["train", RECIPE, "--print-config"],
             ["train", "--help"]]
    result = subprocess.run([sys.executable, "-c", probe.format(argvs=argvs)], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    lines = result.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("code")] == ["code 2", "code 2", "code 0", "code 0"], lines
    assert lines[-1] == "[]", f"imported for a recipe check: {lines[-1]}"
    assert "error: override rl.clip_low=3: Input should be less than or equal to 1" in result.stderr
