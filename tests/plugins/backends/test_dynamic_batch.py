"""Dynamic micro-batches (``use_dynamic_bsz``): micro-batches cut by a token budget instead of a row count
give the same update as fixed ones, at 1 and at 2 processes; log-probs and values come back in the batch's
row order; rows are balanced over data-parallel ranks by tokens; a budget below the longest sequence is a
user error.

Tolerances: padded rows repeat the same float32 sums in any grouping, so weights after an AdamW step agree to
1e-6 (lr 1e-3) and gradient norms to 1e-5 relative; over 2 processes the gradient is also summed over
ranks: 1e-6 as in tests/plugins/backends/test_fsdp.py,
    1e-5 for the key projection's bias (its gradient is rounding noise
only).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from typing import Any

import pytest
import torch
from test_backend_torch import critic_batch, grpo_loss, make_batch, weights
from test_fsdp import free_port

from rlx.batch import Batch
from rlx.config import validate
from rlx.dispatch import balance_for_ranks, shard
from rlx.errors import ConfigError, UserError
from rlx.plugins.backends.torch_local import TorchBackend
from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
from rlx.protocols import RoleSpec
from rlx.records import ForwardOptions
from rlx.step import _token_bins, role_settings, row_tokens

BUDGET = 25  # tokens per micro-batch: the test batch's rows hold 7 to 14 tokens, 84 in all
WORLD = 2


@pytest.fixture
def model_path(tiny_model_path, one_thread):
    return tiny_model_path


def dynamic(budget: int = BUDGET, **options: Any) -> dict[str, Any]:
    """ForwardOptions' arguments for token budgets of ``budget`` (padded rows)."""
    return {"use_dynamic_bsz": True, "use_remove_padding": False,
            "ppo_max_token_len": budget, "ppo_max_token_len_option": "actor.ppo_max_token_len_per_gpu",
            "log_prob_max_token_len": budget, "log_prob_max_token_len_option": "actor.log_prob_max_token_len_per_gpu",
            **options}


def make(path: str, role: str = "actor", rank: int = 0, world: int = 1, micro: int = 8,
         **options: Any) -> TorchWorker:
    forward = ForwardOptions(**{"log_prob_micro_batch_size": micro, "use_remove_padding": False, **options})
    spec = RoleSpec(role=role, model_path=path, trainable=True, value_head=role == "critic", lr=1e-3,
                    micro_batch_size=micro, forward=forward)
    return TorchWorker(spec, TorchBackendOptions(), "cpu", rank, world)


def counting(loss_fn: Any, sizes: list[tuple[int, int]]) -> Any:
    """``loss_fn`` that records each micro-batch's rows and tokens."""
    def fn(outputs: dict[str, torch.Tensor], mb: Batch, ctx: Any) -> Any:
        sizes.append((len(mb), sum(row_tokens(mb))))
        return loss_fn(outputs, mb, ctx)

    return fn


def test_token_bins_respect_the_budget_and_the_count():
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(50, 200)
        needed = len(_token_bins(tokens, budget, 0))
        assert needed >= -(-sum(tokens) // budget)
        for count in {needed, min(len(tokens), needed + 3)}:
            bins = _token_bins(tokens, budget, count)
            assert len(bins) == count
            assert sorted(i for b in bins for i in b) == list(range(len(tokens)))
            assert all(sum(tokens[i] for i in b) <= budget for b in bins)


def test_token_bins_are_even_not_a_remainder():
    # eight rows of 10 tokens, a budget of 70: first-fit needs two groups and fills them 70 + 10; they get 40 + 40
    assert [len(b) for b in _token_bins([10] * 8, 70, 0)] == [4, 4]
    tokens = [30, 25, 20, 15, 10, 5]
    bins = _token_bins(tokens, 60, 0)  # first-fit: 30+25+5, 20+15+10; even: 30+15+10 = 55 and 25+20+5 = 50
    assert [sum(tokens[i] for i in b) for b in bins] == [55, 50]
    assert [len(b) for b in _token_bins([10] * 8, 70, 3)] == [3, 3, 2]  # another rank needs three
    assert [len(b) for b in _token_bins([0, 0, 0], 10, 3)] == [1, 1, 1]  # rows of no tokens: no empty group
    # where the even rule cannot place every row, first-fit's groups stay: 3+3 and 2+2+2 under a budget of 6,
    # where lightest-first puts the 3s apart, a 2 beside each, and has no room for the last 2
    tokens = [3, 3, 2, 2, 2]
    assert sorted(sorted(tokens[i] for i in b) for b in _token_bins(tokens, 6, 0)) == [[2, 2, 2], [3, 3]]


def gradients_at_step(worker: TorchWorker) -> dict[str, torch.Tensor]:
    """Filled with the accumulated gradients each time ``worker`` takes an optimizer step."""
    grads: dict[str, torch.Tensor] = {}
    step = worker.optimizer_step

    def recording() -> tuple[float, bool, float]:
        grads.update({n: p.grad.detach().clone() for n, p in worker.model.named_parameters()})
        return step()

    worker.optimizer_step = recording  # type: ignore[method-assign]
    return grads


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_dynamic_update_equals_the_fixed_one(model_path, packed):
    """One step on 8 sequences: one micro-batch of 8 rows, or micro-batches of at most 25 tokens: the same
    accumulated gradient (1e-5 of each tensor's largest entry), and padded, the same weights after AdamW where
    the gradient is not near zero.
    (Packed, each grouping is another attention shape whose rounding AdamW's first step magnifies on
    gradients near zero: the weights are compared through the gradients.)"""
    fixed = make(model_path, use_remove_padding=packed)
    varied = make(model_path, micro=1, **dynamic(use_remove_padding=packed))
    grads_fixed, grads_varied = gradients_at_step(fixed), gradients_at_step(varied)
    start = weights(fixed)
    seen_fixed: list[tuple[int, int]] = []
    seen: list[tuple[int, int]] = []
    m_fixed = fixed.train_step(make_batch(), counting(grpo_loss(loss_agg_mode="seq-mean-token-mean"), seen_fixed))
    m_dyn = varied.train_step(make_batch(), counting(grpo_loss(loss_agg_mode="seq-mean-token-mean"), seen))
    assert seen_fixed == [(8, 84)]
    assert len(seen) == 4 and all(tokens <= BUDGET for _, tokens in seen) and sum(r for r, _ in seen) == 8
    assert max(r for r, _ in seen) > 1  # rows grouped by tokens, not one row per micro-batch (micro=1)
    moved = max(float((weights(fixed)[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-4
    for k, g in grads_fixed.items():
        torch.testing.assert_close(grads_varied[k], g, atol=1e-5 * float(g.abs().max()), rtol=0, msg=k)
    if not packed:
        # AdamW's first step moves a weight by lr * g / (|g| + eps), about lr * sign(g): compared where the
        # gradient stands well above the rounding another grouping adds (1e-5 of the largest, as above);
        # nearer zero a rounding can flip the sign on some CPUs, and the gradients were compared instead.
        after = weights(varied)
        for k, v in weights(fixed).items():
            if k not in grads_fixed:  # a tied head: its weight is the embedding's
                continue
            g = grads_fixed[k].abs()
            sure = g > 1e-4 * float(g.max())
            assert sure.float().mean() > 0.5, k
            torch.testing.assert_close(after[k][sure], v[sure], atol=1e-6, rtol=0, msg=k)
    assert m_dyn["grad_norm"] == pytest.approx(m_fixed["grad_norm"], rel=1e-5)
    for key in ("actor/entropy", "actor/pg_clipfrac", "actor/pg_loss"):
        assert m_dyn[key] == pytest.approx(m_fixed[key], rel=1e-5, abs=1e-7), key


def test_dynamic_log_probs_and_values_come_back_in_row_order(model_path):
    batch = make_batch()
    mask = batch["response_mask"].bool()
    fixed = make(model_path).compute_log_probs(batch, with_entropy=True)
    varied = make(model_path, **dynamic(budget=20)).compute_log_probs(batch, with_entropy=True)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(varied[key][mask], fixed[key][mask], atol=1e-6, rtol=0, msg=key)
    values = [make(model_path, "critic", **options).compute_values(batch)["values"] for options in ({}, dynamic(20))]
    torch.testing.assert_close(values[1], values[0], atol=1e-6, rtol=0)


def test_a_budget_below_the_longest_sequence_is_a_user_error(model_path):
    worker = make(model_path, **dynamic(budget=13))  # the longest row holds 14 tokens
    with pytest.raises(UserError, match=r"14 tokens .* actor\.ppo_max_token_len_per_gpu=13") as info:
        worker.train_step(make_batch(), grpo_loss())
    assert "Raise actor.ppo_max_token_len_per_gpu" in info.value.hint
    with pytest.raises(UserError, match=r"actor\.log_prob_max_token_len_per_gpu=13"):
        worker.compute_log_probs(make_batch())
    with pytest.raises(ConfigError) as cfg:
        validate({"actor": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 1000},
                  "critic": {"use_dynamic_bsz": True, "forward_max_token_len_per_gpu": 100}})
    text = "\n".join(cfg.value.problems)
    assert "actor.ppo_max_token_len_per_gpu: 1000 is smaller than the longest sequence" in text and "1024" in text
    assert "critic.forward_max_token_len_per_gpu: 100" in text
    assert "log_prob_max_token_len_per_gpu" not in text  # 16384 >= 1024
    validate({"actor": {"ppo_max_token_len_per_gpu": 10}})  # without use_dynamic_bsz the budget is unused


def test_cli_reports_a_small_budget_with_exit_status_2(tmp_path):
    env = {**os.environ, "RLX_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1", "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "rlx", "config", "show", "actor.use_dynamic_bsz=true",
                           "actor.ppo_max_token_len_per_gpu=8", "data.max_prompt_length=16",
                           "data.max_response_length=4"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "actor.ppo_max_token_len_per_gpu: 8 is smaller than the longest sequence" in proc.stderr
    assert "= 20" in proc.stderr


def test_role_settings_reach_the_workers(model_path):
    from rlx.context import BuildContext
    from rlx.protocols import RunInfo

    config = validate({"actor": {"use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": 4096,
                                 "use_remove_padding": False, "log_prob_chunk_size": 0},
                       "critic": {"forward_max_token_len_per_gpu": 2048}})
    assert role_settings(config, "ref") == role_settings(config, "actor")
    assert role_settings(config, "critic").forward.log_prob_max_token_len == 2048
    backend = TorchBackend(TorchBackendOptions(), "cpu",
                           {r: role_settings(config, r) for r in ("actor", "ref", "critic")})
    ref = backend.worker(RoleSpec(role="ref", model_path=model_path, trainable=False))
    assert ref.forward_budget == (4096, "actor.log_prob_max_token_len_per_gpu")
    assert not ref.packed and ref.chunk_size == 0
    # the spec's own forward options win over the config's
    critic = backend.worker(RoleSpec(role="critic", model_path=model_path, trainable=True, value_head=True,
                                     forward=ForwardOptions(use_remove_padding=False)))
    assert critic.forward_budget is None and not critic.packed
    from rlx.plugins.backends.torch_local import build

    built = build(None, BuildContext(config, RunInfo(".", "p", "e", {})))
    assert built.settings["actor"].forward.log_prob_max_token_len == 4096


def test_a_specs_own_settings_win_field_by_field():
    """with_role_settings: each forward option a spec leaves at its default takes the config's, each it sets
    stays; a spec without LoRA takes the config's adapters."""
    import dataclasses

    from rlx.plugins.modeling.model import with_role_settings
    from rlx.records import LoraSpec, RoleSettings

    config = ForwardOptions(use_dynamic_bsz=True, ppo_max_token_len=64, ppo_max_token_len_option="actor.x",
                            log_prob_max_token_len=32, log_prob_chunk_size=0, model_dtype="bfloat16")
    own = ForwardOptions(use_remove_padding=False, log_prob_micro_batch_size=2, log_prob_chunk_size=5)
    assert own.over(config) == dataclasses.replace(config, use_remove_padding=False, log_prob_micro_batch_size=2,
                                                   log_prob_chunk_size=5)
    assert ForwardOptions().over(config) == config and config.over(ForwardOptions()) == config
    lora = LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj"])
    settings = {"actor": RoleSettings(config, lora)}
    spec = RoleSpec(role="actor", model_path="unused", trainable=True, forward=own)
    merged = with_role_settings(spec, settings)
    assert merged.forward == own.over(config) and merged.lora == lora and lora.target_modules == ("q_proj",)
    mine = LoraSpec(rank=8, alpha=8.0)
    assert with_role_settings(dataclasses.replace(spec, lora=mine), settings).lora == mine
    assert with_role_settings(dataclasses.replace(spec, role="critic"), settings) == dataclasses.replace(
        spec, role="critic")  # no settings for the role: the spec as it is
    with pytest.raises(ValueError, match="needs ppo_max_token_len"):
        _ = ForwardOptions(use_dynamic_bsz=True).update_budget


def test_balance_for_ranks_keeps_the_row_counts_and_evens_the_tokens(model_path):
    batch = make_batch()  # tokens per row: 11, 10, 7, 13, 11, 9, 9, 14
    batch = batch.index(sorted(range(8), key=lambda i: row_tokens(batch)[i]))  # ranks get 35 and 49 tokens
    tokens = row_tokens(batch)
    balanced = balance_for_ranks(batch, 2)
    assert sorted(row_tokens(balanced)) == sorted(tokens)
    before = [sum(row_tokens(c)) for c in batch.chunk(2)]
    after = [sum(row_tokens(c)) for c in balanced.chunk(2)]
    assert [len(c) for c in balanced.chunk(2)] == [len(c) for c in batch.chunk(2)]
    assert max(before) - min(before) == 14 and max(after) - min(after) <= 2
    plain = Batch({"x": torch.arange(8)})
    assert balance_for_ranks(plain, 2) is plain  # nothing to count tokens by
    # the order of a mini-batch's rows does not change its update
    a, b = make(model_path, micro=2), make(model_path, micro=2)
    a.train_step(batch, grpo_loss())
    b.train_step(balanced, grpo_loss())
    after_b = weights(b)
    for k, v in weights(a).items():
        torch.testing.assert_close(after_b[k], v, atol=1e-6, rtol=0, msg=k)


# -- 2 processes (gloo): every rank runs as many micro-batches, and the update is the fixed one ------
def _rank_main(rank: int, world: int, port: int, path: str, data: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        actor = make(path, "actor", rank, world, micro=1, **dynamic())
        sizes: list[tuple[int, int]] = []
        minis = [balance_for_ranks(m, world) for m in data["minibatches"]]
        metrics = actor.update(shard(minis, world)[rank], counting(grpo_loss(), sizes))
        critic = make(path, "critic", rank, world, micro=1, **dynamic())
        values = critic.compute_values(shard(data["batch"], world)[rank])["values"]
        torch.save({"metrics": metrics, "sizes": sizes, "weights": weights(actor), "values": values},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_processes_dynamic_equals_one_process_fixed(model_path, tmp_path):
    import torch.multiprocessing as mp

    batch = critic_batch()
    batch.tensors["old_log_probs"] = make(model_path).compute_log_probs(batch)["log_probs"]
    minis = batch.index(torch.randperm(8, generator=torch.Generator().manual_seed(3))).split(4)
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(_rank_main, args=(WORLD, free_port(), model_path, {"minibatches": minis, "batch": batch},
                                             str(tmp_path)), nprocs=WORLD, join=True, start_method="spawn")
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    fixed = make(model_path, micro=4)
    want = fixed.update(minis, grpo_loss())
    want_values = make(model_path, "critic").compute_values(batch)["values"]
    assert len(ranks[0]["sizes"]) == len(ranks[1]["sizes"])  # the same number of passes on every rank
    for r, res in enumerate(ranks):
        assert all(tokens <= BUDGET for _, tokens in res["sizes"])
        for got, exp in zip(res["metrics"], want):
            for key in ("grad_norm", "actor/pg_loss", "actor/entropy"):
                assert got[key] == pytest.approx(exp[key], rel=1e-5, abs=1e-7), (r, key)
        for k, v in weights(fixed).items():
            atol = 1e-5 if k.endswith("k_proj.bias") else 1e-6
            torch.testing.assert_close(res["weights"][k], v, atol=atol, rtol=0, msg=f"rank {r}: {k}")
    mask = batch["response_mask"].bool()
    got_values = torch.cat([res["values"] for res in ranks])
    torch.testing.assert_close(got_values[mask], want_values[mask], atol=1e-6, rtol=0)
