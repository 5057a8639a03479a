"""The ``fsdp2`` and ``fsdp`` backends on 2 gloo processes (CPU, float32) against the ``torch`` backend in one.

One run per engine (a module fixture) does the work on 2 ranks, each rank getting
``rlx.dispatch.shard(data, 2)[rank]`` as a launcher would give it, and on one rank in this
process (a one-rank group that the backend initialises itself); the tests compare the results with the
single-process ``torch`` backend on the same data. Tolerance: float32 on the CPU; the sharded and the plain
model add the same numbers in different orders (gradient sums over ranks, norms over shards), so weights
agree to 1e-6 absolute (1e-5 for the key projection's bias, whose gradient is rounding noise only) and
gradient norms and losses to 1e-5 relative.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_backend_torch import CTX, TEMPERATURE, critic_batch, grpo_loss, make_batch

from rlx.batch import Batch
from rlx.dispatch import shard
from rlx.errors import UserError
from rlx.plugins.algorithms.base import CriticLoss
from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
from rlx.protocols import RoleSpec

pytestmark = pytest.mark.multiproc

ENGINES = ["fsdp2", "fsdp"]
WORLD = 2
EPOCHS, MINI, SEED = 2, 4, 7
ATOL, RTOL = 1e-6, 1e-5
# The key projection's bias has a zero gradient in exact arithmetic (a softmax ignores a constant added
# to all of a query's scores); AdamW normalises its rounding noise, which differs with the summation order.
NOISE_ONLY, NOISE_ATOL = "k_proj.bias", 1e-5
# The policy loss is a sum of terms of both signs (advantages above and below the mean), so its relative
# error grows where they cancel: at 0.203 it differed by 3.7e-6 (1.8e-5 relative) between 1 and 2 ranks on
# an AMD EPYC, every other metric within 5e-6 relative. It is compared to this absolute tolerance too.
SIGNED_LOSSES, SIGNED_ATOL = ("actor/pg_loss",), 2e-5
# A warm-up and a cosine schedule, so that a resumed step uses the restored scheduler's lr.
SCHEDULE = {"warmup_steps": 2, "total_steps": 8, "lr_schedule": "cosine"}


def actor_spec(path: str) -> RoleSpec:
    return RoleSpec(role="actor", model_path=path, trainable=True, lr=3e-4, micro_batch_size=2, **SCHEDULE)


def critic_spec(path: str) -> RoleSpec:
    return RoleSpec(role="critic", model_path=path, trainable=True, value_head=True, lr=1e-3,
                    micro_batch_size=2, **SCHEDULE)


def ref_spec(path: str) -> RoleSpec:
    return RoleSpec(role="ref", model_path=path, trainable=False, micro_batch_size=3)


def actor_loss() -> Any:
    return grpo_loss(loss_agg_mode="seq-mean-token-sum")


def minibatches(batch: Batch) -> list[Batch]:
    """The mini-batches ``rlx.trainer.ppo_update`` cuts: 2 shuffled epochs of mini-batches of 4 rows."""
    gen = torch.Generator().manual_seed(SEED)
    out: list[Batch] = []
    for _ in range(EPOCHS):
        out.extend(batch.index(torch.randperm(len(batch), generator=gen)).split(MINI))
    return out


def fsdp_worker(spec: RoleSpec, engine: str) -> Any:
    from rlx.plugins.backends.fsdp import FSDP2Options, FSDPOptions, FSDPWorker

    return FSDPWorker(spec, FSDP2Options() if engine == "fsdp2" else FSDPOptions(), "cpu", engine)


def state(pairs: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pairs}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- what every rank of the 2-process run does ----------------------------------------------------
def _rank_main(rank: int, world: int, port: int, engine: str, path: str, data: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    from rlx.run.models import load_tokenizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        batch, extra = data["batch"], data["extra"]
        ref, critic, actor = (fsdp_worker(ref_spec(path), engine), fsdp_worker(critic_spec(path), engine),
                              fsdp_worker(actor_spec(path), engine))
        mine = shard(batch, world)[rank]
        res: dict[str, Any] = {"dp": (actor.dp_rank, actor.dp_size)}
        lp = ref.compute_log_probs(mine, with_entropy=True, temperature=TEMPERATURE)
        res["log_probs"], res["entropy"] = lp["log_probs"], lp["entropy"]
        res["values"] = critic.compute_values(mine)["values"]
        res["actor_metrics"] = actor.update(shard(minibatches(batch), world)[rank], actor_loss(), CTX)
        res["critic_metrics"] = critic.update(shard(minibatches(batch), world)[rank], CriticLoss(0.2), CTX)
        res["actor_weights"] = state(actor.named_weights())
        res["critic_weights"] = state(critic.named_weights())
        actor.save_checkpoint(os.path.join(out, "ckpt2"))
        res["extra_metrics"] = actor.update(shard([extra], world)[rank], actor_loss(), CTX)
        res["extra_weights"] = state(actor.named_weights())
        actor.save_pretrained(os.path.join(out, "hf"), load_tokenizer(path, False))
        # a checkpoint written by one rank, loaded into two
        resumed = fsdp_worker(actor_spec(path), engine)
        resumed.load_checkpoint(data["ckpt1"])
        res["rng_after_load"] = torch.get_rng_state()
        res["from_one_metrics"] = resumed.update(shard([extra], world)[rank], actor_loss(), CTX)
        res["from_one_weights"] = state(resumed.named_weights())
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def torch_reference(tiny_model_path: str) -> dict[str, Any]:
    """The single-process ``torch`` backend on the same data: the numbers every FSDP run must give."""
    torch.set_num_threads(1)
    path = tiny_model_path
    batch = critic_batch()
    # old log-probs of the starting policy: the first epoch is on-policy, the second clips some tokens
    batch.tensors["old_log_probs"] = TorchWorker(ref_spec(path), TorchBackendOptions(), "cpu").compute_log_probs(
        batch, temperature=TEMPERATURE)["log_probs"]
    extra = make_batch(seed=5)
    ref = TorchWorker(ref_spec(path), TorchBackendOptions(), "cpu")
    critic = TorchWorker(critic_spec(path), TorchBackendOptions(), "cpu")
    actor = TorchWorker(actor_spec(path), TorchBackendOptions(), "cpu")
    res: dict[str, Any] = {"batch": batch, "extra": extra}
    lp = ref.compute_log_probs(batch, with_entropy=True, temperature=TEMPERATURE)
    res["log_probs"], res["entropy"] = lp["log_probs"], lp["entropy"]
    res["values"] = critic.compute_values(batch)["values"]
    res["actor_metrics"] = actor.update(minibatches(batch), actor_loss(), CTX)
    res["critic_metrics"] = critic.update(minibatches(batch), CriticLoss(0.2), CTX)
    res["actor_weights"] = state(actor.model.state_dict().items())
    res["critic_weights"] = state(critic.model.state_dict().items())
    res["extra_metrics"] = actor.update([extra], actor_loss(), CTX)
    res["extra_weights"] = state(actor.model.state_dict().items())
    return res


@pytest.fixture(scope="module", params=ENGINES)
def runs(request: pytest.FixtureRequest, tiny_model_path: str, torch_reference: dict[str, Any],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine: the same work on one rank (in this process) and on two (spawned processes)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    engine, path = request.param, tiny_model_path
    out = tmp_path_factory.mktemp(engine)
    batch, extra = torch_reference["batch"], torch_reference["extra"]
    assert not dist.is_initialized()
    try:
        one = fsdp_worker(actor_spec(path), engine)  # no group yet: the backend makes a one-rank one
        assert dist.get_world_size() == 1 and (one.dp_rank, one.dp_size) == (0, 1)
        single: dict[str, Any] = {"actor_metrics": one.update(minibatches(batch), actor_loss(), CTX)}
        single["actor_weights"] = state(one.named_weights())
        single["buckets"] = [[(n, t.clone()) for n, t in b] for b in one.weight_buckets(20_000)]
        one.save_checkpoint(str(out / "ckpt1"))
        single["extra_metrics"] = one.update([extra], actor_loss(), CTX)
        del one
        ckpt_spec = dataclasses.replace(actor_spec(path), gradient_checkpointing=True)
        recompute = fsdp_worker(ckpt_spec, engine)
        single["checkpointed_metrics"] = recompute.update(minibatches(batch), actor_loss(), CTX)
        single["checkpointed_weights"] = state(recompute.named_weights())
        single["checkpointing_on"] = bool(recompute.hf_class.is_gradient_checkpointing.fget(recompute.model))
        del recompute

        env = {"OMP_NUM_THREADS": "1"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            mp.start_processes(_rank_main, args=(WORLD, free_port(), engine, path,
                                                 {"batch": batch, "extra": extra, "ckpt1": str(out / "ckpt1")},
                                                 str(out)),
                               nprocs=WORLD, join=True, start_method="spawn")
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]

        # a checkpoint written by two ranks, loaded into one
        resumed = fsdp_worker(actor_spec(path), engine)
        resumed.load_checkpoint(str(out / "ckpt2"))
        single["from_two_metrics"] = resumed.update([extra], actor_loss(), CTX)
        single["from_two_weights"] = state(resumed.named_weights())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"engine": engine, "single": single, "ranks": ranks, "out": out}


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
            atol = SIGNED_ATOL if k in SIGNED_LOSSES else 1e-7
            assert g[k] == pytest.approx(w[k], rel=RTOL, abs=atol), f"{what} step {step}: {k}"


# -------------------------------------------------------------------------------------------------
def test_update_matches_the_torch_backend(runs: dict[str, Any], torch_reference: dict[str, Any]) -> None:
    """2 epochs x 2 mini-batches (4 optimizer steps, micro-batches of 2) on 1 and on 2 ranks give the torch
    backend's losses, clip fractions, gradient norms, learning rates and updated weights."""
    want = torch_reference
    moved = max(float((want["actor_weights"][k] - want["extra_weights"][k]).abs().max()) for k in want["actor_weights"])
    assert moved > 1e-5  # the steps changed the weights measurably
    assert max(m["actor/pg_clipfrac"] for m in want["actor_metrics"][2:]) > 0.05  # the second epoch clips
    assert all(m["grad_norm"] > 0 for m in want["actor_metrics"])
    assert_metrics(runs["single"]["actor_metrics"], want["actor_metrics"], "actor, 1 rank")
    assert_weights(runs["single"]["actor_weights"], want["actor_weights"], "actor, 1 rank")
    # gradient checkpointing (recomputed activations) changes nothing
    assert runs["single"]["checkpointing_on"]
    assert_metrics(runs["single"]["checkpointed_metrics"], want["actor_metrics"], "actor, 1 rank, checkpointing")
    assert_weights(runs["single"]["checkpointed_weights"], want["actor_weights"], "actor, 1 rank, checkpointing")
    for r, res in enumerate(runs["ranks"]):
        assert res["dp"] == (r, WORLD)
        assert_metrics(res["actor_metrics"], want["actor_metrics"], f"actor, rank {r} of 2")
        assert_metrics(res["critic_metrics"], want["critic_metrics"], f"critic, rank {r} of 2")
        assert_weights(res["actor_weights"], want["actor_weights"], f"actor, rank {r} of 2")
        assert_weights(res["critic_weights"], want["critic_weights"], f"critic, rank {r} of 2")


def test_log_probs_and_values_match_the_torch_backend(runs: dict[str, Any], torch_reference: dict[str, Any]) -> None:
    mask = torch_reference["batch"]["response_mask"].bool()
    for key in ("log_probs", "entropy", "values"):
        got = torch.cat([res[key] for res in runs["ranks"]])  # the launcher's gather: rank order
        assert got.shape == torch_reference[key].shape, key
        torch.testing.assert_close(got[mask], torch_reference[key][mask], atol=1e-5, rtol=0, msg=key)


def test_named_weights_are_full_tensors_with_hf_names_on_every_rank(
        runs: dict[str, Any], torch_reference: dict[str, Any], tiny_model_path: str) -> None:
    from transformers import AutoModelForCausalLM

    names = set(AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict())
    for res in runs["ranks"]:
        assert set(res["extra_weights"]) == names
        assert_weights(res["extra_weights"], torch_reference["extra_weights"], "after the extra step")
    buckets = runs["single"]["buckets"]
    assert len(buckets) > 1
    assert [n for b in buckets for n, _ in b] == list(runs["single"]["actor_weights"])
    for b in buckets:
        assert len(b) == 1 or sum(t.numel() * t.element_size() for _, t in b) <= 20_000
    assert_weights(dict(p for b in buckets for p in b), runs["single"]["actor_weights"], "buckets")


def test_checkpoints_reshard_between_one_and_two_ranks(runs: dict[str, Any], torch_reference: dict[str, Any]) -> None:
    """Saved after the 4 steps, loaded into the other world size, the fifth step (lr from the restored
    warm-up/cosine schedule, AdamW moments from the restored optimizer) gives the uninterrupted weights."""
    want_m, want_w = torch_reference["extra_metrics"], torch_reference["extra_weights"]
    assert want_m[0]["lr"] != torch_reference["actor_metrics"][0]["lr"]
    assert_metrics(runs["single"]["extra_metrics"], want_m, "1 rank, uninterrupted")
    assert_metrics(runs["single"]["from_two_metrics"], want_m, "2 -> 1 ranks")
    assert_weights(runs["single"]["from_two_weights"], want_w, "2 -> 1 ranks")
    for r, res in enumerate(runs["ranks"]):
        assert_metrics(res["extra_metrics"], want_m, f"rank {r}, uninterrupted")
        assert_metrics(res["from_one_metrics"], want_m, f"1 -> 2 ranks, rank {r}")
        assert_weights(res["from_one_weights"], want_w, f"1 -> 2 ranks, rank {r}")
    ckpt = runs["out"] / "ckpt2"
    assert sorted(p.name for p in ckpt.iterdir()) == ["dcp", "rank0.pt", "rank1.pt"]
    # RNG states are per rank, not resharded: rank 0 continues the saved stream, a new rank r starts
    # from seed + r
    saved = torch.load(runs["out"] / "ckpt1" / "rank0.pt", weights_only=True)["cpu_rng"]
    assert torch.equal(runs["ranks"][0]["rng_after_load"], saved)
    fresh = torch.Generator().manual_seed(actor_spec("unused").seed + 1).get_state()
    assert torch.equal(runs["ranks"][1]["rng_after_load"], fresh)


def test_save_pretrained_loads_with_from_pretrained(runs: dict[str, Any], torch_reference: dict[str, Any],
                                                    tiny_model_path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = runs["out"] / "hf"
    assert (folder / "model.safetensors").exists() and (folder / "generation_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    assert_weights(state(model.state_dict().items()), torch_reference["extra_weights"], "exported")
    text = "12+7=19"
    assert AutoTokenizer.from_pretrained(folder).encode(text) == AutoTokenizer.from_pretrained(
        tiny_model_path).encode(text)


# -- loading never runs code ----------------------------------------------------------------------
class _Payload:
    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.flag}",))


def test_planted_dcp_metadata_pickle_is_refused(runs: dict[str, Any], tmp_path: Path, tiny_model_path: str) -> None:
    import shutil

    import torch.distributed as dist

    from rlx.plugins.modeling.dist import read_dcp_metadata

    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["out"] / "ckpt2", ckpt)
    with open(ckpt / "dcp" / ".metadata", "rb") as f:  # the genuine index reads
        assert read_dcp_metadata(f, "genuine").state_dict_metadata
    flag = tmp_path / "FLAG"
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(flag)))
    try:
        worker = fsdp_worker(actor_spec(tiny_model_path), runs["engine"])
        with pytest.raises(UserError, match="Refused"):
            worker.load_checkpoint(str(ckpt))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert not flag.exists()
    # a genuine class outside the allow-list is refused too
    with pytest.raises(UserError, match="Refused"):
        read_dcp_metadata(io.BytesIO(pickle.dumps(SimpleNamespace(a=1))), "other")
    assert not flag.exists()


def test_planted_non_tensor_entry_is_refused(tmp_path: Path) -> None:
    """Non-tensor entries (optimizer hyper-parameters) load with weights_only: a payload there is refused."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from rlx.plugins.modeling.dist import _safe_planner

    flag = tmp_path / "FLAG"
    item = SimpleNamespace(dest_index=MetadataIndex("optim.param_groups.lr"))
    with pytest.raises(UserError, match="Refused"):
        _safe_planner().load_bytes(item, io.BytesIO(pickle.dumps(_Payload(flag))))
    assert not flag.exists()


def test_options_and_bad_input() -> None:
    from pydantic import ValidationError

    from rlx.plugins.backends.fsdp import FSDP2Options, FSDPOptions, FSDPWorker

    with pytest.raises(ValidationError):
        FSDP2Options(reshard_after_forwards=False)
    with pytest.raises(ValidationError):
        FSDPOptions(reshard_after_forward=False)  # an FSDP2 option
    with pytest.raises(UserError, match="cpu_offload"):
        FSDPWorker(actor_spec("unused"), FSDP2Options(cpu_offload=True), "cpu", "fsdp2")
