"""`epirl kernels explain`: which W8A16 kernel runs for each projection of a model, per token count, on an H100 or
H200 - the choices of `epirl.kernels.plan.plan`, computed without a GPU.

    epirl kernels explain                                  # Qwen3-8B, 1 / 16 / 4096 tokens, H100
    epirl kernels explain --model Qwen3.5-9B --tokens 1 64 8192 --device h200 --rank 32

One row per (projection, tokens, call): `engine` is the matched engine's forward, `trainer` the FP8 trainer's forward
(it keeps xa for the backward) and `dX` its backward GEMM. Projections are the calls the engine and the trainer make:
q, k, v as one call over the fused layer (`kernels.fused_slices`, its LoRA rank S·r) unless --fused-slices off; gate,
up as one call each. Columns: the layer's GEMM `N×K`, the kernel (`plan`'s names: ws_ticket split-K in one launch,
ws_split partial + reduce, ws_single / ws_tma / ws_gluon one pass per tile), its tile (BN/BM/BK/warps/stages), the
K chunks, TMA / Gluon, whether the base GEMM is lora_down's programmatic dependent (PDL), how xa is computed, and the
launches of the call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from epirl.console import DefaultsHelpFormatter, error_line

DEFAULT_MODEL = "Qwen3-8B"
DEFAULT_TOKENS = (1, 16, 4096)
CALLS = ("engine", "trainer", "dX")


def add_kernels_args(subparsers) -> argparse.ArgumentParser:
    """Register the ``kernels`` subcommand (``kernels explain``) on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser("kernels", help="what epirl's kernels run for a model's projections",
                                   description=__doc__, formatter_class=DefaultsHelpFormatter)
    actions = parser.add_subparsers(dest="action", required=True)
    explain = actions.add_parser("explain", help="the kernel plan per projection and token count (one table)",
                                 description=__doc__, formatter_class=DefaultsHelpFormatter)
    explain.add_argument("--model", default=DEFAULT_MODEL,
                         help="a model config: a name under recipes/configs/ (Qwen3-8B, Qwen3.5-9B), a folder with "
                              "config.json, or a config.json file")
    explain.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS), help="token counts (M)")
    explain.add_argument("--device", choices=["h100", "h200"], default="h100", help="the GPU to plan for")
    explain.add_argument("--rank", type=int, default=64, help="LoRA rank (0: no adapter)")
    explain.add_argument("--fused-slices", choices=["on", "off"], default="on",
                         help="q, k, v as one call (kernels.fused_slices)")
    explain.add_argument("--json", action="store_true", help="the rows as JSON instead of a table")
    explain.set_defaults(func=run_kernels_command)
    return parser


def load_model_config(model: str) -> dict:
    """The text model's config.json fields (a multimodal config's `text_config`)."""
    # deferred: epirl.model loads torch and transformers, which `epirl kernels --help` need not
    from epirl.model.dummy import shipped_config_dir

    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    elif not path.is_file():
        shipped = shipped_config_dir(model)
        if shipped is None:
            raise ValueError(f"--model {model}: not a config.json, a folder with one, or a name under recipes/configs/")
        path = shipped / "config.json"
    config = json.loads(path.read_text())
    return {**config, **config.get("text_config", {})}


def projections(config: dict, fused_slices: bool = True) -> list[tuple[str, int, int, int]]:
    """(name, N, K, LoRA slices) of each W8A16 call of one decoder layer of each kind, as the engine and the trainer
    make them: the fused q, k, v as one call of S slices (rank S·r) with fused_slices, else one each."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    gated = config.get("attn_output_gate", config.get("model_type", "").startswith(("qwen3_5", "qwen3_next")))
    q = heads * head_dim * (2 if gated else 1)  # a gated attention's q_proj also holds the gate
    rows = ([("qkv", q + 2 * kv * head_dim, hidden, 3)] if fused_slices else
            [("q", q, hidden, 1), ("k", kv * head_dim, hidden, 1), ("v", kv * head_dim, hidden, 1)])
    rows.append(("o", hidden, heads * head_dim, 1))
    if "linear_attention" in config.get("layer_types", []):  # Qwen3.5's gated DeltaNet layers
        nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
        nv, dv = config["linear_num_value_heads"], config["linear_value_head_dim"]
        rows += [("in_proj_qkv", 2 * nk * dk + nv * dv, hidden, 1), ("in_proj_z", nv * dv, hidden, 1),
                 ("in_proj_b", nv, hidden, 1), ("in_proj_a", nv, hidden, 1), ("out_proj", hidden, nv * dv, 1)]
    return rows + [("gate", inter, hidden, 1), ("up", inter, hidden, 1), ("down", hidden, inter, 1)]


def _describe(p) -> dict:
    """One table row's fields of a `KernelPlan`."""
    kind = ("Gluon" + (" ring" if p.ring else "") + (" persistent" if p.persistent else "") if p.kernel == "ws_gluon"
            else "TMA" if p.tma else "-")
    down = "-" if p.down is None else p.down.kernel + (f" x{p.down.group}" if p.down.group > 1 else "")
    if p.fused_down:
        down = "in split-K"
    return dict(kernel=p.kernel, tile="/".join(map(str, p.tile)), chunks=f"{p.n_chunks}x{p.k_chunk}", loads=kind,
                pdl="yes" if p.pdl else "-", lora_down=down, launches=p.launches)


def explain_rows(config: dict, tokens, device, rank: int = 64, fused_slices: bool = True) -> list[dict]:
    """The plan of every (projection, tokens, call) of `config` on `device` (a `plan.Device`), as table rows."""
    # deferred: epirl.kernels loads torch, which `epirl kernels --help` need not
    from epirl.kernels.plan import plan

    rows = []
    for name, N, K, slices in projections(config, fused_slices):
        r = rank * slices
        for M in tokens:
            calls = {"engine": plan("w8a16", (N, K), M, device, rank=r),
                     "trainer": plan("w8a16", (N, K), M, device, rank=r, return_xa=bool(r)),
                     "dX": plan("w8a16_dx", (K, N), M, device, rank=r, xa_given=bool(r))}
            for call, p in calls.items():
                rows.append(dict(projection=name, shape=f"{N}x{K}", tokens=M, call=call, **_describe(p)))
    return rows


def render(rows: list[dict], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in rows[0]:
        table.add_column(column, justify="right" if column in ("tokens", "launches") else "left")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    return table


def run_kernels_command(args: argparse.Namespace) -> int:
    # deferred: epirl.kernels loads torch, which `epirl kernels --help` need not
    from epirl.kernels.plan import NAMED

    try:
        config = load_model_config(args.model)
    except (OSError, ValueError, KeyError) as exc:
        error_line(Console(stderr=True), str(exc))
        return 2
    fused = args.fused_slices == "on"
    rows = explain_rows(config, args.tokens, NAMED[args.device], args.rank, fused)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    title = (f"{args.model} on {args.device.upper()}, LoRA rank {args.rank}, q, k, v as "
             f"{'one call' if fused else 'one call each'}")
    Console(width=200).print(render(rows, title))
    return 0
