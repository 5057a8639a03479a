"""Ulysses sequence parallelism (``ulysses_sequence_parallel_size``) in the FSDP backends.

The worker-level tests run 2 gloo processes forming one sequence-parallel group (sp=2: each rank holds half
of every packed row, one data-parallel rank) and compare with the single-process ``torch`` backend on the
same data: log-probs and entropies (chunked head and plain head), critic values, and 4 optimizer steps of
the actor (fsdp2, fsdp2 with gradient checkpointing, fsdp) and of the critic (losses, gradient norms and the
updated weights). The tiny model has 2 query heads and 1 key/value head, so sp=2 also runs the repeated
key/value heads. Tolerance: float32 on the CPU; the split attention adds the same numbers in other orders,
so log-probs and values agree to 1e-5 absolute, losses and gradient norms to 1e-5 relative (1e-6 absolute
for metrics that are 0 up to rounding) and weights to 1e-6 absolute (1e-5 for the key projection's bias, whose gradient is rounding noise only; as in
tests/test_fsdp.py).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from test_backend_torch import critic_batch, grpo_loss

from rlx.batch import Batch
from rlx.errors import UserError
from rlx.plugins.algorithms.base import CriticLoss
from rlx.plugins.backends.torch_local import TorchBackendOptions, TorchWorker
from rlx.plugins.launchers.local import shard
from rlx.protocols import RoleSpec

SP = {"ulysses_sequence_parallel_size": 2}
PLAIN_HEAD = {"log_prob_chunk_size": 0}
EPOCHS, MINI, SEED = 2, 4, 7
ATOL, RTOL = 1e-6, 1e-5
NOISE_ONLY, NOISE_ATOL = "k_proj.bias", 1e-5
# The first epoch is on-policy: its ppo_kl is rounding noise around 0 (about 1e-7 either way).
METRIC_ATOL = 1e-6


def actor_spec(path: str, **extra: Any) -> RoleSpec:
    return RoleSpec(role="actor", model_path=path, trainable=True, lr=3e-4, micro_batch_size=2, warmup_steps=2,
                    total_steps=8, lr_schedule="cosine", extra=extra)


def critic_spec(path: str, **extra: Any) -> RoleSpec:
    return RoleSpec(role="critic", model_path=path, trainable=True, value_head=True, lr=1e-3, micro_batch_size=2,
                    extra=extra)


def ref_spec(path: str, **extra: Any) -> RoleSpec:
    return RoleSpec(role="ref", model_path=path, trainable=False, micro_batch_size=3, extra=extra)


def minibatches(batch: Batch) -> list[Batch]:
    gen = torch.Generator().manual_seed(SEED)
    out: list[Batch] = []
    for _ in range(EPOCHS):
        out.extend(batch.index(torch.randperm(len(batch), generator=gen)).split(MINI))
    return out


def state(pairs: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pairs}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp_worker(spec: RoleSpec, engine: str = "fsdp2") -> Any:
    from rlx.plugins.backends.fsdp import FSDP2Options, FSDPOptions, FSDPWorker

    return FSDPWorker(spec, FSDP2Options() if engine == "fsdp2" else FSDPOptions(), "cpu", engine)


def _rank_main(rank: int, world: int, port: int, path: str, batch: Batch, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res: dict[str, Any] = {}
        ref = fsdp_worker(ref_spec(path, **SP))
        info = ref.dispatch_info()
        res["dispatch"] = (info.dp_rank, info.dp_size, info.collect)
        mine = shard(batch, info.dp_size)[info.dp_rank]
        res["log_probs"] = dict(ref.compute_log_probs(mine, with_entropy=True).tensors)
        del ref
        plain = fsdp_worker(ref_spec(path, **SP, **PLAIN_HEAD))
        res["plain_log_probs"] = dict(plain.compute_log_probs(mine, with_entropy=True).tensors)
        del plain
        critic = fsdp_worker(critic_spec(path, **SP))
        res["values"] = critic.compute_values(mine)["values"]
        mbs = shard(minibatches(batch), info.dp_size)[info.dp_rank]
        res["critic_metrics"] = critic.update(mbs, CriticLoss(0.2))
        res["critic_weights"] = state(critic.named_weights())
        del critic
        for name, spec, engine in (
                ("actor", actor_spec(path, **SP), "fsdp2"),
                ("checkpointed", dataclasses.replace(actor_spec(path, **SP), gradient_checkpointing=True), "fsdp2"),
                ("fsdp1", actor_spec(path, **SP), "fsdp")):
            actor = fsdp_worker(spec, engine)
            res[f"{name}_metrics"] = actor.update(mbs, grpo_loss(loss_agg_mode="seq-mean-token-sum"))
            res[f"{name}_weights"] = state(actor.named_weights())
            del actor
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _grid_rank_main(rank: int, world: int, port: int, path: str, batch: Batch, out: str) -> None:
    """4 processes: 2 data-parallel ranks, each a sequence-parallel group of 2 consecutive ranks."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        actor = fsdp_worker(actor_spec(path, **SP))
        info = actor.dispatch_info()
        res: dict[str, Any] = {"dispatch": (info.dp_rank, info.dp_size, info.collect)}
        res["log_probs"] = dict(actor.compute_log_probs(shard(batch, info.dp_size)[info.dp_rank],
                                                        with_entropy=True).tensors)
        res["actor_metrics"] = actor.update(shard(minibatches(batch), info.dp_size)[info.dp_rank],
                                            grpo_loss(loss_agg_mode="seq-mean-token-sum"))
        res["actor_weights"] = state(actor.named_weights())
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(fn: Any, world: int, path: str, batch: Batch, out: Path) -> list[Any]:
    import torch.multiprocessing as mp

    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(fn, args=(world, free_port(), path, batch, str(out)), nprocs=world, join=True,
                           start_method="spawn")
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


@pytest.fixture(scope="module")
def reference(tiny_model_path: str) -> dict[str, Any]:
    """The single-process torch backend on the same data."""
    torch.set_num_threads(1)
    path = tiny_model_path
    batch = critic_batch()
    batch.tensors["old_log_probs"] = TorchWorker(ref_spec(path), TorchBackendOptions(), "cpu").compute_log_probs(
        batch)["log_probs"]
    res: dict[str, Any] = {"batch": batch}
    res["log_probs"] = dict(TorchWorker(ref_spec(path), TorchBackendOptions(), "cpu").compute_log_probs(
        batch, with_entropy=True).tensors)
    res["plain_log_probs"] = dict(TorchWorker(ref_spec(path, **PLAIN_HEAD), TorchBackendOptions(), "cpu")
                                  .compute_log_probs(batch, with_entropy=True).tensors)
    critic = TorchWorker(critic_spec(path), TorchBackendOptions(), "cpu")
    res["values"] = critic.compute_values(batch)["values"]
    res["critic_metrics"] = critic.update(minibatches(batch), CriticLoss(0.2))
    res["critic_weights"] = state(critic.model.state_dict().items())
    actor = TorchWorker(actor_spec(path), TorchBackendOptions(), "cpu")
    res["actor_metrics"] = actor.update(minibatches(batch), grpo_loss(loss_agg_mode="seq-mean-token-sum"))
    res["actor_weights"] = state(actor.model.state_dict().items())
    return res


@pytest.fixture(scope="module")
def sp_ranks(reference: dict[str, Any], tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return spawn(_rank_main, 2, tiny_model_path, reference["batch"], tmp_path_factory.mktemp("ulysses"))


def assert_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k, v in want.items():
        atol = NOISE_ATOL if k.endswith(NOISE_ONLY) else ATOL
        torch.testing.assert_close(got[k], v, atol=atol, rtol=0, msg=f"{what}: {k}")


def assert_metrics(got: list[dict[str, float]], want: list[dict[str, float]], what: str) -> None:
    assert len(got) == len(want), what
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), what
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=RTOL, abs=METRIC_ATOL), f"{what} step {step}: {k}"


def test_a_group_is_one_data_parallel_rank_and_its_first_rank_returns_the_results(sp_ranks: list[Any]) -> None:
    assert [r["dispatch"] for r in sp_ranks] == [(0, 1, True), (0, 1, False)]


def test_log_probs_entropy_and_values_equal_one_process(sp_ranks: list[Any], reference: dict[str, Any]) -> None:
    mask = reference["batch"]["response_mask"].bool()
    for r, res in enumerate(sp_ranks):
        for head in ("log_probs", "plain_log_probs"):
            for key in ("log_probs", "entropy"):
                got, want = res[head][key], reference[head][key]
                assert got.shape == want.shape
                torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0, msg=f"rank {r} {head} {key}")
                assert not got[~mask].any()
        torch.testing.assert_close(res["values"][mask], reference["values"][mask], atol=1e-5, rtol=0)


def test_updates_equal_one_process(sp_ranks: list[Any], reference: dict[str, Any]) -> None:
    """4 optimizer steps (2 epochs x 2 mini-batches, micro-batches of 2 rows): the same losses, gradient
    norms and weights as one process, with fsdp2, fsdp2 with gradient checkpointing (attention recomputed
    in the backward pass) and fsdp; and the critic's update."""
    want = reference
    assert all(m["grad_norm"] > 0 for m in want["actor_metrics"])
    for r, res in enumerate(sp_ranks):
        for name in ("actor", "checkpointed", "fsdp1"):
            assert_metrics(res[f"{name}_metrics"], want["actor_metrics"], f"{name}, rank {r}")
            assert_weights(res[f"{name}_weights"], want["actor_weights"], f"{name}, rank {r}")
        assert_metrics(res["critic_metrics"], want["critic_metrics"], f"critic, rank {r}")
        assert_weights(res["critic_weights"], want["critic_weights"], f"critic, rank {r}")


def test_two_data_parallel_groups_of_two_equal_one_process(reference: dict[str, Any], tiny_model_path: str,
                                                            tmp_path: Path) -> None:
    """4 processes, sp=2: ranks 0-1 and 2-3 are the two data-parallel ranks (each gets half of every
    mini-batch; token counts summed over the data-parallel group only, gradients over all 4 shards)."""
    ranks = spawn(_grid_rank_main, 4, tiny_model_path, reference["batch"], tmp_path)
    assert [r["dispatch"] for r in ranks] == [(0, 2, True), (0, 2, False), (1, 2, True), (1, 2, False)]
    masks = shard(reference["batch"].select("response_mask"), 2)
    log_probs = shard(Batch(reference["log_probs"]), 2)
    for r, res in enumerate(ranks):
        mask = masks[r // 2]["response_mask"].bool()
        torch.testing.assert_close(res["log_probs"]["log_probs"][mask], log_probs[r // 2]["log_probs"][mask],
                                   atol=1e-5, rtol=0)
        assert_metrics(res["actor_metrics"], reference["actor_metrics"], f"actor, rank {r} of 4")
        assert_weights(res["actor_weights"], reference["actor_weights"], f"actor, rank {r} of 4")
