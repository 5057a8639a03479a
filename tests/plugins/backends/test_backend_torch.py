"""The ``torch`` training backend on the built-in tiny Qwen2: log-probs, exact gradient accumulation,
the learning-rate schedule, checkpoints, skipped non-finite steps and frozen roles."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil

import pytest
import torch

from rlx.batch import Batch
from rlx.plugins.algorithms.grpo import GRPOLoss, GRPOOptions
from rlx.plugins.modeling.model import lr_lambda
from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
from rlx.protocols import RoleSpec
from rlx.records import ForwardOptions, UpdateContext

PAD = 0
TEMPERATURE = 0.7
CTX = UpdateContext(temperature=TEMPERATURE)  # the updates run at the sampling temperature, as in training
PROMPT_LENGTHS = [5, 9, 3, 7, 9, 4, 6, 8]
RESPONSE_LENGTHS = [6, 1, 4, 6, 2, 5, 3, 6]  # ragged; every micro-batch of 2 has its own token count


@pytest.fixture
def model_path(tiny_model_path, one_thread):
    return tiny_model_path


def make_worker(path: str, trainable: bool = True, **spec) -> TorchWorker:
    spec.setdefault("lr", 1e-3)
    return TorchWorker(RoleSpec(role="actor" if trainable else "ref", model_path=path, trainable=trainable, **spec),
                       TorchBackendOptions(), "cpu")


def make_batch(seed: int = 0, rows: int = 8) -> Batch:
    """Left-padded prompts, right-padded responses with ragged masks, GRPO inputs and a temperature."""
    g = torch.Generator().manual_seed(seed)
    plens, rlens = PROMPT_LENGTHS[:rows], RESPONSE_LENGTHS[:rows]
    P, R = max(plens), max(rlens)
    prompts = torch.full((rows, P), PAD)
    prompt_mask = torch.zeros((rows, P), dtype=torch.long)
    responses = torch.full((rows, R), PAD)
    response_mask = torch.zeros((rows, R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(plens, rlens)):
        prompts[i, P - p:] = torch.randint(3, 60, (p,), generator=g)
        prompt_mask[i, P - p:] = 1
        responses[i, :r] = torch.randint(3, 60, (r,), generator=g)
        response_mask[i, :r] = 1
    mask = response_mask.float()
    advantages = torch.randn(rows, 1, generator=g) * mask  # one advantage per response, on its tokens
    old_log_probs = (-2.0 - torch.rand(rows, R, generator=g)) * mask
    return Batch({"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses,
                  "response_mask": response_mask, "advantages": advantages, "old_log_probs": old_log_probs})


def weights(worker: TorchWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def grpo_loss(**options) -> GRPOLoss:
    return GRPOLoss(GRPOOptions(use_kl_loss=False, **options))


def manual_log_probs(model, batch: Batch, temperature: float) -> list[torch.Tensor]:
    """Each row's response log-probs from a forward pass on the row alone, without any padding."""
    out = []
    with torch.no_grad():
        for i in range(len(batch)):
            prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()]
            response = batch["responses"][i][batch["response_mask"][i].bool()]
            logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0].float() / temperature
            lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
            out.append(lp.gather(-1, response[:, None]).squeeze(-1))
    return out


# ---------------------------------------------------------------------------------------------
def test_compute_log_probs_matches_manual(model_path):
    worker = make_worker(model_path, trainable=False, micro_batch_size=3)
    batch = make_batch()
    out = worker.compute_log_probs(batch, with_entropy=True, temperature=TEMPERATURE)
    R = batch["responses"].shape[1]
    assert out["log_probs"].shape == (8, R) and out["entropy"].shape == (8, R)
    assert not out["log_probs"].requires_grad
    expected = manual_log_probs(worker.model, batch, TEMPERATURE)
    mask = batch["response_mask"].bool()
    for i, want in enumerate(expected):
        torch.testing.assert_close(out["log_probs"][i][mask[i]], want, atol=1e-5, rtol=0)
    # Entropy of the tempered distribution, checked on one row.
    with torch.no_grad():
        p = batch["prompts"][0][batch["prompt_mask"][0].bool()]
        r = batch["responses"][0][mask[0]]
        logits = worker.model(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1:-1] / TEMPERATURE
    ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(out["entropy"][0][mask[0]], ent, atol=1e-5, rtol=0)
    # The micro-batch size does not change how rows are scored; without a temperature they are scored at 1.0.
    worker.spec = dataclasses.replace(worker.spec, forward=ForwardOptions(log_prob_micro_batch_size=8))
    whole = worker.compute_log_probs(batch, temperature=TEMPERATURE)
    torch.testing.assert_close(whole["log_probs"][mask], out["log_probs"][mask], atol=1e-5, rtol=0)
    plain = Batch(dict(batch.tensors))
    at_one = worker.compute_log_probs(plain)
    for i, want in enumerate(manual_log_probs(worker.model, batch, 1.0)):
        torch.testing.assert_close(at_one["log_probs"][i][mask[i]], want, atol=1e-5, rtol=0)


def test_compute_log_probs_is_deterministic_with_dropout(model_path, tmp_path):
    """A trainable model configured with dropout scores tokens without it, and stays in train mode."""
    folder = tmp_path / "model"
    shutil.copytree(model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["attention_dropout"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))
    worker = make_worker(str(folder), micro_batch_size=8)
    assert worker.model.training
    batch = make_batch()
    first, second = worker.compute_log_probs(batch), worker.compute_log_probs(batch)
    assert torch.equal(first["log_probs"], second["log_probs"])
    assert worker.model.training
    critic = make_critic(str(folder), micro_batch_size=8)  # the critic's values likewise
    assert torch.equal(critic.compute_values(batch)["values"], critic.compute_values(batch)["values"])
    assert critic.model.training


# Weights after one AdamW step agree to ATOL_PADDED: micro-batches of padded rows repeat the same float32
# sums. Packed rows share one attention call whose length is the micro-batch's token count, so its sums
# are ordered differently (log-probs agree to about 4e-6); AdamW's first step divides each gradient by its
# own magnitude, which turns that rounding into weight differences of up to 2e-6 on gradients near zero
# (lr is 1e-3; a lost or doubly counted micro-batch moves weights by about lr): ATOL_PACKED.
ATOL_PADDED, ATOL_PACKED = 1e-6, 1e-5


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gradient_accumulation_is_exact(model_path, agg, packed):
    """One step on 8 sequences: a single micro-batch of 8 and four of 2 give the same weights."""
    whole = make_worker(model_path, micro_batch_size=8, forward=ForwardOptions(use_remove_padding=packed))
    micro = make_worker(model_path, micro_batch_size=2, forward=ForwardOptions(use_remove_padding=packed))
    assert whole.packed is packed
    start = weights(whole)
    m_whole = whole.train_step(make_batch(), grpo_loss(loss_agg_mode=agg), CTX)
    m_micro = micro.train_step(make_batch(), grpo_loss(loss_agg_mode=agg), CTX)
    after_whole, after_micro = weights(whole), weights(micro)
    moved = max(float((after_whole[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-4  # the step did something measurable
    for k in start:
        torch.testing.assert_close(after_micro[k], after_whole[k], atol=ATOL_PACKED if packed else ATOL_PADDED,
                                   rtol=0, msg=k)
    assert m_whole["skipped_step"] == m_micro["skipped_step"] == 0.0
    assert m_micro["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-5)
    for key in ("actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):  # token means over the mini-batch
        assert m_micro[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_reported_pg_loss_does_not_depend_on_micro_batches(model_path, agg):
    whole = make_worker(model_path, micro_batch_size=8).train_step(make_batch(), grpo_loss(loss_agg_mode=agg), CTX)
    micro = make_worker(model_path, micro_batch_size=2).train_step(make_batch(), grpo_loss(loss_agg_mode=agg), CTX)
    assert micro["actor/pg_loss"] == pytest.approx(whole["actor/pg_loss"], rel=1e-5, abs=1e-7)


def test_lr_schedule_values(model_path):
    base = {"role": "actor", "model_path": "unused", "trainable": True}
    warm_cos = lr_lambda(RoleSpec(**base, warmup_steps=2, total_steps=6, lr_schedule="cosine"))
    expected = [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0]
    assert [warm_cos(s) for s in range(7)] == pytest.approx(expected)
    assert warm_cos(100) == pytest.approx(0.0)  # stays at the floor after total_steps
    floor = lr_lambda(RoleSpec(**base, total_steps=4, lr_schedule="cosine", min_lr_ratio=0.1))
    assert [floor(s) for s in (0, 2, 4)] == pytest.approx([1.0, 0.1 + 0.9 * 0.5, 0.1])
    linear = lr_lambda(RoleSpec(**base, warmup_steps=1, total_steps=5, lr_schedule="linear"))
    assert [linear(s) for s in range(6)] == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    constant = lr_lambda(RoleSpec(**base, warmup_steps=4, total_steps=10))
    assert [constant(s) for s in (0, 1, 3, 4, 9)] == pytest.approx([0.25, 0.5, 1.0, 1.0, 1.0])

    # The worker reports the lr each step used, and steps the schedule once per train_step.
    worker = make_worker(model_path, lr=1e-2, warmup_steps=2, total_steps=6, lr_schedule="cosine",
                         micro_batch_size=2)
    small = make_batch(rows=2)
    used = [worker.train_step(small, grpo_loss(), CTX)["lr"] for _ in range(4)]
    assert used == pytest.approx([1e-2 * f for f in expected[:4]])


def test_checkpoint_round_trip(model_path, tmp_path):
    loss = grpo_loss()
    a = make_worker(model_path, micro_batch_size=4, warmup_steps=2, total_steps=5, lr_schedule="cosine")
    a.train_step(make_batch(seed=1), loss, CTX)
    a.save_checkpoint(str(tmp_path / "ckpt"))
    saved = weights(a)
    saved_optim = copy.deepcopy(a.optimizer.state_dict())
    m_a = a.train_step(make_batch(seed=2), loss, CTX)
    after_a = weights(a)

    b = make_worker(model_path, micro_batch_size=4, warmup_steps=2, total_steps=5, lr_schedule="cosine")
    assert any(not torch.equal(v, saved[k]) for k, v in weights(b).items())
    b.load_checkpoint(str(tmp_path / "ckpt"))
    for k, v in weights(b).items():
        assert torch.equal(v, saved[k]), k
    loaded = b.optimizer.state_dict()
    assert loaded["param_groups"] == saved_optim["param_groups"]
    assert loaded["state"].keys() == saved_optim["state"].keys() and loaded["state"]
    for idx, state in saved_optim["state"].items():
        for name, value in state.items():
            assert torch.equal(loaded["state"][idx][name], value), (idx, name)
    assert b.scheduler.last_epoch == 1

    m_b = b.train_step(make_batch(seed=2), loss, CTX)
    for k, v in weights(b).items():
        assert torch.equal(v, after_a[k]), k
    assert m_b == m_a


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_non_finite_loss_skips_the_step(model_path):
    worker = make_worker(model_path, micro_batch_size=4)
    before = weights(worker)
    bad = make_batch()
    bad.tensors["advantages"][3, 0] = float("nan")
    metrics = worker.train_step(bad, grpo_loss(), CTX)
    assert metrics["skipped_step"] == 1.0
    assert not math.isfinite(metrics["grad_norm"])
    for k, v in weights(worker).items():
        assert torch.equal(v, before[k]), k
    assert not worker.optimizer.state  # AdamW moments untouched by the bad batch
    assert all(p.grad is None for p in worker.model.parameters())

    def inf_loss(outputs, mb, ctx):
        return outputs["log_probs"].sum() * float("inf"), {}

    assert worker.train_step(make_batch(), inf_loss, CTX)["skipped_step"] == 1.0
    for k, v in weights(worker).items():
        assert torch.equal(v, before[k]), k
    # The next good batch trains normally.
    good = worker.train_step(make_batch(), grpo_loss(), CTX)
    assert good["skipped_step"] == 0.0 and math.isfinite(good["grad_norm"])
    assert any(not torch.equal(v, before[k]) for k, v in weights(worker).items())


def test_frozen_role_has_no_optimizer_and_no_grads(model_path):
    worker = make_worker(model_path, trainable=False, micro_batch_size=4)
    assert worker.optimizer is None and worker.scheduler is None
    assert not worker.model.training
    assert all(not p.requires_grad for p in worker.model.parameters())
    out = worker.compute_log_probs(make_batch(), with_entropy=True)
    assert not out["log_probs"].requires_grad
    assert all(p.grad is None for p in worker.model.parameters())
    with pytest.raises(AssertionError, match="not trainable"):
        worker.train_step(make_batch(), grpo_loss(), CTX)


# ---------------------------------------------------------------------------------------------
# The critic: a value model on the policy's architecture
def make_critic(path: str, **spec) -> TorchWorker:
    spec.setdefault("lr", 1e-3)
    return TorchWorker(RoleSpec(role="critic", model_path=path, trainable=True, value_head=True, **spec),
                       TorchBackendOptions(), "cpu")


def critic_batch(seed: int = 0) -> Batch:
    batch = make_batch(seed)
    g = torch.Generator().manual_seed(seed + 100)
    mask = batch["response_mask"].float()
    batch.tensors["values"] = torch.randn(len(batch), mask.shape[1], generator=g) * 0.1 * mask
    batch.tensors["returns"] = (torch.rand(len(batch), 1, generator=g) * mask)
    return batch


def test_critic_values_are_aligned_with_the_state_before_each_token(model_path):
    """values[:, t] is the head's output at the position that predicts response token t (the state
    made of the prompt and response[:t]), the same position as the actor's log-prob of token t; the
    head is fresh (one output) on top of the policy's own transformer weights."""
    from transformers import AutoModelForCausalLM

    critic = make_critic(model_path, micro_batch_size=3)
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    body = dict(critic.model.model.named_parameters())
    for name, p in policy.model.named_parameters():
        assert torch.equal(body[name], p), name  # the transformer comes from the checkpoint
    assert critic.model.score.out_features == 1
    batch = make_batch()
    out = critic.compute_values(batch)["values"]
    mask = batch["response_mask"].bool()
    assert out.shape == mask.shape and torch.all(out[~mask] == 0)
    with torch.no_grad():
        for i in range(len(batch)):
            prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()]
            response = batch["responses"][i][mask[i]]
            v = critic.model(input_ids=torch.cat([prompt, response])[None]).logits[0, :, 0]
            torch.testing.assert_close(out[i][mask[i]], v[len(prompt) - 1:-1], atol=1e-5, rtol=0)
    with pytest.raises(AssertionError, match="value model"):
        critic.compute_log_probs(batch)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_critic_gradient_accumulation_is_exact(model_path, packed):
    from rlx.plugins.algorithms.base import CriticLoss

    whole = make_critic(model_path, micro_batch_size=8, forward=ForwardOptions(use_remove_padding=packed))
    micro = make_critic(model_path, micro_batch_size=2, forward=ForwardOptions(use_remove_padding=packed))
    assert whole.packed is packed
    start = weights(whole)
    batch = critic_batch()
    # old values near the model's own, so that the clip range of 0.05 binds on some tokens, whatever the
    # fresh value head's initial outputs are
    noise = torch.randn(batch["values"].shape, generator=torch.Generator().manual_seed(3)) * 0.1
    batch.tensors["values"] = (whole.compute_values(batch)["values"] + noise) * batch["response_mask"]
    m_whole = whole.train_step(copy.deepcopy(batch), CriticLoss(0.05), CTX)
    m_micro = micro.train_step(copy.deepcopy(batch), CriticLoss(0.05), CTX)
    moved = max(float((weights(whole)[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-4
    after_micro = weights(micro)
    for k, v in weights(whole).items():
        torch.testing.assert_close(after_micro[k], v, atol=ATOL_PACKED if packed else ATOL_PADDED, rtol=0, msg=k)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "grad_norm"):
        assert m_micro[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-7), key
    assert 0 < m_whole["critic/vf_clipfrac"] < 1  # the small clip range is active on some tokens


def test_critic_checkpoint_round_trip(model_path, tmp_path):
    from rlx.plugins.algorithms.base import CriticLoss

    a = make_critic(model_path, micro_batch_size=4)
    a.train_step(critic_batch(1), CriticLoss(0.5), CTX)
    a.save_checkpoint(str(tmp_path / "critic"))
    b = make_critic(model_path, micro_batch_size=4)
    b.load_checkpoint(str(tmp_path / "critic"))
    for k, v in weights(b).items():
        assert torch.equal(v, weights(a)[k]), k
    assert b.train_step(critic_batch(2), CriticLoss(0.5), CTX) == a.train_step(critic_batch(2), CriticLoss(0.5), CTX)
    # a saved critic loads as a value model with its trained head (critic.model_path=...)
    a.save_pretrained(str(tmp_path / "hf"))
    c = make_critic(str(tmp_path / "hf"))
    torch.testing.assert_close(c.compute_values(make_batch())["values"], a.compute_values(make_batch())["values"])


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_ppo_epochs_minibatches_microbatches_are_exact(model_path, role):
    """2 PPO epochs x 2 shuffled mini-batches of 4 rows: micro-batches of 2 (accumulated) and of 4 (one
    pass per mini-batch) end with the same weights, for the actor and for the critic."""
    from rlx.plugins.algorithms.base import CriticLoss
    from rlx.plugins.launchers.local import LocalWorkerGroup
    from rlx.trainer import ppo_update

    batch = critic_batch()
    # old log-probs of the starting policy: the first epoch is on-policy, the second clips some tokens
    batch.tensors["old_log_probs"] = make_worker(model_path).compute_log_probs(batch)["log_probs"]

    def run(micro: int) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
        if role == "actor":
            worker = make_worker(model_path, micro_batch_size=micro, lr=3e-4)
            loss = grpo_loss(loss_agg_mode="seq-mean-token-sum")
        else:
            worker, loss = make_critic(model_path, micro_batch_size=micro), CriticLoss(0.2)
        metrics: dict[str, list[float]] = {}
        ppo_update(LocalWorkerGroup(role, [worker]), batch, loss, epochs=2, mini_size=4, shuffle=True,
                   seed=7, prefix=role, metrics=metrics)
        return weights(worker), metrics

    (w_micro, m_micro), (w_whole, m_whole) = run(2), run(4)
    assert len(m_whole[f"{role}/grad_norm"]) == 4  # 2 epochs x 2 mini-batches = 4 optimizer steps
    if role == "actor":
        assert m_whole["actor/pg_clipfrac"][:2] == [0.0, 0.0] and max(m_whole["actor/pg_clipfrac"][2:]) > 0.1
    for k, v in w_whole.items():
        # The key projection's bias has a gradient of exactly 0 in exact arithmetic (adding one vector to
        # every key shifts a query's scores by a constant, which softmax ignores), so AdamW normalises
        # rounding noise there into steps of up to lr: those weights agree to the learning rate only.
        atol = 1e-3 if k.endswith("k_proj.bias") else 1e-6
        torch.testing.assert_close(w_micro[k], v, atol=atol, rtol=0, msg=k)
    assert m_micro[f"{role}/grad_norm"] == pytest.approx(m_whole[f"{role}/grad_norm"], rel=1e-5)


def test_entropy_is_differentiated_only_when_the_loss_uses_it(model_path):
    from rlx.plugins.modeling.head import response_log_probs

    worker = make_worker(model_path)
    batch = make_batch()
    lp, ent = response_log_probs(worker.model, batch, TEMPERATURE, with_entropy=True, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    _, ent_grad = response_log_probs(worker.model, batch, TEMPERATURE, with_entropy=True)
    assert ent_grad.requires_grad
    assert torch.allclose(ent, ent_grad.detach())
    assert GRPOLoss(GRPOOptions(entropy_coeff=0.0)).needs_entropy_grad is False
    assert GRPOLoss(GRPOOptions(entropy_coeff=0.01)).needs_entropy_grad is True


def test_resume_with_a_longer_schedule_uses_the_new_schedule_at_once(model_path, tmp_path):
    """A run saved at step 2 of a 4-step cosine schedule and resumed with 8 steps takes its next step at the
    8-step schedule's learning rate, not at the one the checkpoint recorded."""
    short = make_worker(model_path, lr=1e-3, total_steps=4, lr_schedule="cosine")
    for _ in range(2):
        short.train_step(make_batch(), grpo_loss(), CTX)
    short.save_checkpoint(str(tmp_path / "ckpt"))
    long = make_worker(model_path, lr=1e-3, total_steps=8, lr_schedule="cosine")
    long.load_checkpoint(str(tmp_path / "ckpt"))
    expected = 1e-3 * lr_lambda(long.spec)(2)
    assert expected != pytest.approx(1e-3 * lr_lambda(short.spec)(2))
    assert long.train_step(make_batch(), grpo_loss(), CTX)["lr"] == pytest.approx(expected, rel=1e-9)
