"""How the trainer wires the roles together, in-process on the built-in tiny model (a few seconds each):
the rollout engine gets the actor's new weights after every update, one training step takes
``ppo_epochs x train_batch_size / ppo_mini_batch_size`` optimizer steps of ``ppo_mini_batch_size x n``
sequences, a resumed run continues exactly (weights, optimizer, RNG state and data position), epochs roll
over inside a run, and dynamic sampling without a generation limit cannot hang."""

from __future__ import annotations

import signal
import types
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from pydantic import BaseModel, ConfigDict

from rlx import Component, hookimpl
from rlx.errors import UserError
from rlx.plugins.tasks import builtin
from rlx.registry import PluginManager
from rlx.trainer import Trainer
from rlx.validate import load_config

QUIET = ["trainer.test_freq=-1", "trainer.loggers=[]", "trainer.save_hf_model=false", "trainer.log_samples=0"]
# An entropy bonus makes every update move the weights: with 4 prompts x 2 samples every group may score
# the same (zero advantages), and at step 1 the KL loss has no gradient (actor = reference).
SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "algorithm.entropy_coeff=0.01"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One torch thread: the same run gives the same numbers, so resumed and straight runs compare exactly."""


def make_trainer(out: Path, *overrides: str, pm: PluginManager | None = None) -> Trainer:
    if pm is None:
        pm = PluginManager()
        pm.load_entry_points(strict=False, disabled=[])
    resolved = load_config(pm, preset="tiny", overrides=[*QUIET, f"trainer.output_dir={out}", *overrides])
    return Trainer(resolved, pm)


def actor_weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.actor.workers[0].named_weights()}


def rollout_weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.rollout.workers[0].model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)


# ---------------------------------------------------------------------------------------------
def test_rollout_engine_gets_the_actors_weights_after_every_update(tmp_path):
    t = make_trainer(tmp_path, *SMALL, "trainer.total_steps=2", "trainer.save_freq=0")
    generated_with: list[dict[str, torch.Tensor]] = []
    engine = t.rollout.workers[0]
    generate = engine.generate

    def recording_generate(prompts, params):
        generated_with.append(rollout_weights(t))
        return generate(prompts, params)

    engine.generate = recording_generate
    after_step: list[dict[str, torch.Tensor]] = []
    initial = actor_weights(t)
    engine_after_step: list[dict[str, torch.Tensor]] = []

    def record(step, metrics):
        after_step.append(actor_weights(t))
        engine_after_step.append(rollout_weights(t))

    on_step_end(t, record)
    t.fit()
    assert len(generated_with) == 2 and len(after_step) == 2
    assert same(generated_with[0], initial), "step 1 samples from the initial policy"
    assert not same(after_step[0], initial), "the update changed the actor"
    assert same(generated_with[1], after_step[0]), "step 2 samples from the policy after step 1's update"
    assert not same(after_step[1], after_step[0])
    for step in range(2):
        assert same(engine_after_step[step], after_step[step]), f"the engine holds the policy after update {step + 1}"


def on_step_end(t: Trainer, fn) -> None:
    """Call ``fn(step, metrics)`` at the end of every step, through the trainer's own hook."""
    def rlx_on_step_end(step, metrics):
        fn(step, metrics)

    plugin = types.ModuleType(f"rlx_test_step_end_{id(fn)}")
    plugin.rlx_on_step_end = hookimpl(rlx_on_step_end)
    t.pm.register(plugin, name=plugin.__name__)


# ---------------------------------------------------------------------------------------------
def test_optimizer_steps_per_training_step(tmp_path):
    """ppo_epochs=2, 4 prompts, mini-batches of 2 prompts, n=4: 2 x 4/2 = 4 optimizer steps per training
    step, each over 2 x 4 = 8 sequences (in micro-batches of 3), and a linear schedule that spans exactly
    the run's optimizer steps."""
    t = make_trainer(tmp_path, "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4",
                     "actor.ppo_epochs=2", "actor.micro_batch_size_per_device=3", "actor.optim.lr_schedule=linear",
                     "trainer.total_steps=2", "trainer.save_freq=0")
    rows_per_step: list[int] = []
    pending: list[int] = []
    lrs: list[float] = []
    worker = t.actor.workers[0]
    optimizer = worker.optimizer

    def after_optimizer_step(opt, args, kwargs):
        lrs.append(opt.param_groups[0]["lr"])
        rows_per_step.append(sum(pending))
        pending.clear()

    optimizer.register_step_post_hook(after_optimizer_step)
    make_loss = t.algorithm.policy_loss_fn

    def counting_loss_fn():
        loss_fn = make_loss()

        def fn(outputs, micro, ctx):
            pending.append(len(micro))
            return loss_fn(outputs, micro, ctx)

        return fn

    t.algorithm.policy_loss_fn = counting_loss_fn
    t.fit()
    assert rows_per_step == [8] * 8, rows_per_step  # 2 training steps x 4 optimizer steps
    lr = t.cfg.actor.optim.lr
    assert lrs == pytest.approx([lr * (1 - i / 8) for i in range(8)])


# ---------------------------------------------------------------------------------------------
RESUME = [*SMALL, "actor.optim.lr_schedule=cosine", "trainer.total_steps=3"]


class _Crash(Exception):
    pass


def test_resume_restores_weights_optimizer_rng_and_data_position(tmp_path):
    """A run that dies right after its step-2 checkpoint, resumed by a new Trainer, takes step 3 with the
    same prompts, responses, weights and metrics as one uninterrupted run."""
    straight = make_trainer(tmp_path / "straight", *RESUME)
    seen_straight = _record_steps(straight)
    final_straight = straight.fit()

    first = make_trainer(tmp_path / "split", *RESUME, "trainer.save_freq=2")

    def crash(step, path):
        raise _Crash(path)

    plugin = types.ModuleType("rlx_test_crash_after_save")
    plugin.rlx_on_checkpoint = hookimpl(crash)
    first.pm.register(plugin, name=plugin.__name__)
    with pytest.raises(Exception) as crashed:  # the trainer may wrap a hook's exception in a UserError
        first.fit()
    assert isinstance(crashed.value, _Crash) or "_Crash" in str(crashed.value), crashed.value
    assert first.step == 2
    resumed = make_trainer(tmp_path / "split", *RESUME)
    assert resumed.resume_from is not None and resumed.resume_from.name == "global_step_2"
    seen_resumed = _record_steps(resumed)
    final_resumed = resumed.fit()

    assert resumed.step == 3 and len(seen_resumed) == 1
    assert resumed.loader.state_dict() == straight.loader.state_dict()
    assert seen_resumed[0]["prompts"] == seen_straight[2]["prompts"], "the data position was restored"
    assert torch.equal(seen_resumed[0]["responses"], seen_straight[2]["responses"]), "the RNG state was restored"
    a, b = actor_weights(straight), actor_weights(resumed)
    for k in a:  # weights, Adam moments and the schedule position all feed into step 3's update
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-7, msg=k)
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/lr"):
        assert final_resumed[key] == pytest.approx(final_straight[key], rel=1e-6, abs=1e-8), key


def _record_steps(t: Trainer) -> list[dict]:
    """What each training step drew: its prompts (as text) and the responses generated for them."""
    seen: list[dict] = []
    step = t.train_step

    def recording(examples):
        seen.append({"prompts": [e.text for e in examples]})
        return step(examples)

    engine = t.rollout.workers[0]
    generate = engine.generate

    def recording_generate(prompts, params):
        out = generate(prompts, params)
        seen[-1]["responses"] = out["responses"].clone()
        return out

    t.train_step = recording
    engine.generate = recording_generate
    return seen


# ---------------------------------------------------------------------------------------------
@pytest.fixture
def six_prompts(tmp_path) -> Path:
    """A training file of 6 arithmetic prompts in the verl row shape."""
    path = tmp_path / "six.parquet"
    pd.DataFrame(builtin.arith_rows("train", 6, seed=3)).to_parquet(path)
    return path


def test_total_epochs_and_epoch_rollover(tmp_path, six_prompts):
    """6 prompts, batches of 2, total_epochs=2 (no total_steps): 3 steps per epoch, 6 steps; each epoch
    sees every prompt once, and the second epoch in another order."""
    t = make_trainer(tmp_path / "run", f"data.train_files=[{six_prompts}]", "data.val_files=[]",
                     "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2",
                     "trainer.total_steps=null", "trainer.total_epochs=2", "trainer.save_freq=0")
    assert t.total_steps == 6
    seen = _record_steps(t)
    epochs: list[float] = []
    on_step_end(t, lambda step, metrics: epochs.append(metrics["progress/epoch"]))
    t.fit()
    assert t.step == 6 and len(seen) == 6
    first = [p for s in seen[:3] for p in s["prompts"]]
    second = [p for s in seen[3:] for p in s["prompts"]]
    everything = sorted(e.text for e in t.train_set.examples)
    assert sorted(first) == everything and sorted(second) == everything
    assert first != second, "a new epoch reshuffles the prompts"
    assert epochs == [0, 0, 0, 1, 1, 1]


# ---------------------------------------------------------------------------------------------
class _Hang(Exception):
    pass


def _constant_reward(options, ctx):
    return lambda batch: [1.0] * len(batch)


class _AnyOptions(BaseModel):
    """The preset's reward options are the arith reward's; this reward ignores them."""

    model_config = ConfigDict(extra="allow")


def test_dynamic_sampling_without_limit_stops_when_nothing_can_be_kept(tmp_path, six_prompts):
    """Every response gets the same reward, so no group is ever kept. With max_num_gen_batches=0 (no
    limit) the run must still end, with a clear error or after a bounded number of generation batches,
    not loop forever. The training set is 3 batches of 2 prompts, so a minute (hundreds of generation
    batches, over a hundred epochs) is far beyond any sane bound."""
    plugin = types.ModuleType("rlx_test_constant_reward")
    plugin.rlx_rewards = hookimpl(lambda: [Component(kind="reward", name="constant", factory=_constant_reward,
                                                           config_model=_AnyOptions)])
    pm = PluginManager()
    pm.load_entry_points(strict=False, disabled=[])
    pm.register(plugin, name=plugin.__name__)
    t = make_trainer(tmp_path / "run", f"data.train_files=[{six_prompts}]", "data.val_files=[]",
                     "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2",
                     "algorithm.name=dapo", "reward.name=constant",
                     "algorithm.max_num_gen_batches=0", "algorithm.overlong_buffer_len=0",
                     "trainer.total_steps=1", "trainer.save_freq=0", pm=pm)
    generations = 0
    engine = t.rollout.workers[0]
    generate = engine.generate

    def counting(prompts, params):
        nonlocal generations
        generations += 1
        return generate(prompts, params)

    engine.generate = counting

    def on_alarm(signum, frame):
        raise _Hang(f"still generating after {generations} generation batches")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(60)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                metrics = t.fit()
            except UserError as exc:  # a clear stop, saying what happened and what to do
                text = str(exc).lower()
                assert "dynamic sampling" in text and "filter_groups" in text, exc
                assert generations <= 2 * t.loader.batches_per_epoch(), generations
                return
    except _Hang as exc:
        pytest.fail(f"dynamic sampling without a limit hangs: {exc}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert t.step == 1 and generations < 1000, generations
    assert metrics["rollout/num_gen_batches"] == generations
