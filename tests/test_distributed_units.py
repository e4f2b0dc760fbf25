"""Data-parallel scale-out without an engine: slicing, batch ownership, metric reduction, checksums, the
checkpoint's rank count, the torchrun command; and the collectives themselves on 2 real gloo processes."""

import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

from epirl.rl.distributed import (DistributedError, Ranks, adapter_checksum, batch_owners, check_checksums,
                                  rank_slice, redistribute, reduce_metrics)


@pytest.mark.parametrize("count,world", [(0, 2), (1, 2), (3, 2), (8, 3), (7, 4), (5, 8), (16, 1)])
def test_rank_slices_cover_the_items_once_and_balanced(count, world):
    parts = [rank_slice(count, world, r) for r in range(world)]
    covered = [i for p in parts for i in range(p.start, p.stop)]
    assert covered == list(range(count))  # contiguous, in rank order, disjoint
    sizes = [p.stop - p.start for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_batch_owners_are_the_contiguous_slices():
    assert batch_owners(5, 2) == [0, 0, 0, 1, 1]
    assert batch_owners(3, 4) == [0, 1, 2]
    assert batch_owners(4, 1) == [0, 0, 0, 0]


def test_single_rank_redistribute_is_the_identity_in_order():
    keys = [(1, 2), (0, 0), (0, 3)]
    mine = {k: f"group{k}" for k in keys}
    assert redistribute(keys, mine, Ranks()) == [mine[k] for k in keys]


def test_metric_reduction_sums_shares_maxes_times_and_keeps_global_values():
    rank0 = {"loss/pg": -0.25, "is/clipped_frac": 0.1, "train/entropy": 1.0, "reward/graded": 10.0,
             "mismatch/k3_kl": 1e-3, "mismatch/max_abs_logratio": 0.5, "time/train_s": 2.0, "mem/gpu_peak_gib": 3.0,
             "probe/mean_abs_logp_diff": 1e-4, "reward/mean": 0.4, "train/grad_norm": 0.9, "data/cursor": 8.0}
    rank1 = {"loss/pg": -0.5, "is/clipped_frac": 0.2, "train/entropy": 0.5, "reward/graded": 6.0,
             "mismatch/k3_kl": 2e-3, "mismatch/max_abs_logratio": 0.75, "time/train_s": 3.0, "mem/gpu_peak_gib": 2.0,
             "probe/mean_abs_logp_diff": 2e-4, "reward/mean": 0.4, "train/grad_norm": 0.9, "data/cursor": 8.0}
    out = reduce_metrics([rank0, rank1])
    assert out["loss/pg"] == -0.75 and out["is/clipped_frac"] == pytest.approx(0.3)
    assert out["train/entropy"] == 1.5 and out["reward/graded"] == 16.0 and out["mismatch/k3_kl"] == pytest.approx(3e-3)
    assert out["mismatch/max_abs_logratio"] == 0.75 and out["time/train_s"] == 3.0 and out["mem/gpu_peak_gib"] == 3.0
    assert out["probe/mean_abs_logp_diff"] == 2e-4
    assert out["reward/mean"] == 0.4 and out["train/grad_norm"] == 0.9 and out["data/cursor"] == 8.0
    assert list(out) == list(rank0)


def test_metric_reduction_of_token_shares_equals_the_one_rank_token_mean():
    # Each rank reports value × (its tokens / global tokens): the sum is the global token-weighted mean.
    tokens = [30.0, 10.0]
    entropy = [2.0, 1.0]
    total = sum(tokens)
    shares = [{"train/entropy": e * t / total} for e, t in zip(entropy, tokens)]
    assert reduce_metrics(shares)["train/entropy"] == pytest.approx((2.0 * 30 + 1.0 * 10) / 40)


def test_bitwise_fraction_comes_from_the_summed_count_exactly():
    # ten ranks whose share-weighted fractions (0.1 each) sum to 1 - ulp in floats: the count gives 1.0 exactly
    ranks = [{"mismatch/bitwise_frac": 0.1, "mismatch/unequal_tokens": 0.0, "train/tokens": 10.0} for _ in range(10)]
    assert sum(rank["mismatch/bitwise_frac"] for rank in ranks) != 1.0
    assert reduce_metrics(ranks)["mismatch/bitwise_frac"] == 1.0
    ranks[1]["mismatch/unequal_tokens"] = 2.0
    out = reduce_metrics(ranks)
    assert out["mismatch/unequal_tokens"] == 2.0 and out["mismatch/bitwise_frac"] == pytest.approx(0.8)


def test_adapter_checksum_sees_value_order_and_sign_changes():
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    base = adapter_checksum([a, b])
    assert torch.equal(base, adapter_checksum([a.clone(), b.clone()]))
    changed = a.clone()
    changed[1, 2] += 1e-6
    assert not torch.equal(base, adapter_checksum([changed, b]))
    assert not torch.equal(base, adapter_checksum([b, a]))
    assert not torch.equal(base, adapter_checksum([-a, b]))
    check_checksums([base, base.clone()], step=3)
    with pytest.raises(DistributedError, match=r"step 3: the adapter of rank\(s\) \[1\] differs"):
        check_checksums([base, adapter_checksum([changed, b])], step=3)


def test_prompt_seeds_are_spread_and_a_pure_function_of_seed_and_position():
    from epirl.rl.loop import prompt_seed

    seeds = [prompt_seed(0, p) for p in range(2000)]
    assert seeds == [prompt_seed(0, p) for p in range(2000)]
    assert min(abs(x - y) for i, x in enumerate(seeds) for y in seeds[i + 1:i + 50]) > 64  # vLLM uses seed + i
    assert prompt_seed(1, 0) != prompt_seed(0, 0)


def test_checkpoint_records_its_rank_count(tmp_path):
    from epirl.checkpoint import STATE_FILE, checkpoint_world_size

    (tmp_path / STATE_FILE).write_text('{"step": 2, "data": {}}')
    assert checkpoint_world_size(tmp_path) == 1  # written before scale-out
    (tmp_path / STATE_FILE).write_text('{"step": 2, "data": {}, "world_size": 2}')
    assert checkpoint_world_size(tmp_path) == 2


def test_nproc_becomes_the_same_command_under_torchrun():
    from epirl.train_cli import torchrun_command

    argv = ["-v", "train", "r.yaml", "rl.steps=2", "--nproc", "2", "--resume", "runs/x"]
    assert torchrun_command(2, argv) == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                         "--nproc-per-node=2", "-m", "epirl", "-v", "train", "r.yaml", "rl.steps=2",
                                         "--resume", "runs/x"]
    assert torchrun_command(4, ["train", "r.yaml", "--nproc=4"])[-2:] == ["train", "r.yaml"]


# --- the collectives on two gloo processes -------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collectives_worker(rank: int, port: int, results):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    from epirl.rl import distributed

    ranks = distributed.setup(timeout_s=60, use_cuda=False)
    try:
        # 5 kept groups, produced 3 by rank 0 and 2 by rank 1 but interleaved: owners are [0, 0, 0, 1, 1].
        keys = ["a", "b", "c", "d", "e"]
        produced = {0: {"a": "A", "c": "C", "d": "D"}, 1: {"b": "B", "e": "E"}}[rank]
        mine = distributed.redistribute(keys, produced, ranks)
        # Gradients: rank 1 has no gradient on the second parameter (no sequences): it adds zeros.
        p1, p2 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
        p1.grad = torch.full((3,), float(rank + 1))
        if rank == 0:
            p2.grad = torch.ones(2, 2)
        timing = ranks.all_reduce_gradients([p1, p2])
        checksum = ranks.check_adapter([p1.grad, p2.grad], step=1)
        counts = (ranks.sum(3.0 + rank), ranks.any(rank == 1), ranks.any(False))
        diverged = None
        try:
            ranks.check_adapter([p1.grad + rank], step=2)
        except distributed.DistributedError as exc:
            diverged = str(exc)
        results.put((rank, mine, p1.grad.tolist(), p2.grad.tolist(), sorted(timing), checksum, counts, diverged))
    finally:
        distributed.teardown()


@pytest.mark.timeout(120)
def test_collectives_on_two_gloo_ranks():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_collectives_worker, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, *rest = results.get(timeout=100)
        got[rank] = rest
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert got[0][0] == ["A", "B", "C"] and got[1][0] == ["D", "E"]
    for rank in (0, 1):
        mine, g1, g2, timing, checksum, counts, diverged = got[rank]
        assert g1 == [3.0, 3.0, 3.0] and g2 == [[1.0, 1.0], [1.0, 1.0]]
        assert timing == ["dist/grad_allreduce_s", "dist/grad_wait_s"]
        assert counts == (7.0, True, False)
        assert "step 2: the adapter of rank(s) [1] differs from rank 0's" in diverged
    assert got[0][4] == got[1][4]
