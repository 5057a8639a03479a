"""PF-PPO (``algorithm.use_pf_ppo``, verl's ``compute_pf_ppo_reweight_data``): each reweight method's weights worked
by hand, the draw's frequencies, seeded and repeatable resampling (across a checkpoint too), the batch replaced row
by row after the advantages, and bad options as config errors."""

from __future__ import annotations

import pytest
import torch

from rlx.batch import Batch
from rlx.context import BuildContext
from rlx.errors import ConfigError
from rlx.plugins.algorithms import functional as F
from rlx.protocols import RunInfo
from rlx.registry import PluginManager

EPS = 1e-8


@pytest.fixture(scope="module")
def pm() -> PluginManager:
    manager = PluginManager()
    manager.load_entry_points(strict=True, disabled=[])
    return manager


def build(pm, seed: int = 7, **options):
    from rlx.config import RLXConfig

    cfg = RLXConfig()
    cfg.data.max_response_length = 4
    cfg.rollout.n = 2
    cfg.trainer.seed = seed
    comp = pm.get("algorithm", "grpo")
    opts = comp.load_config_model().model_validate({"use_kl_loss": False, **options})
    return comp.load_factory()(opts, BuildContext(cfg, RunInfo("", "p", "e", {}), pm))


def test_weights_of_each_method_by_hand():
    s = torch.tensor([1.0, -2.0, 0.0, 3.0])
    assert torch.allclose(F.pf_ppo_weights(s, "pow", 2.0), torch.tensor([1.0, 4.0, 0.0, 9.0]) + EPS, atol=0)
    assert torch.allclose(F.pf_ppo_weights(s, "pow", 0.5), torch.tensor([1.0, 2**0.5, 0.0, 3**0.5]) + EPS)
    assert torch.allclose(F.pf_ppo_weights(s, "pow", 1.0), torch.tensor([1.0, 2.0, 0.0, 3.0]) + EPS)
    # max_min: the batch's highest (3) and lowest (-2) scores only
    assert F.pf_ppo_weights(s, "max_min", 2.0).tolist() == pytest.approx([EPS, 1.0 + EPS, EPS, 1.0 + EPS])
    # max_random: 0.4 at the highest score, 0.1 elsewhere; ties at the top all get 0.4
    assert F.pf_ppo_weights(s, "max_random", 2.0).tolist() == pytest.approx([0.1 + EPS] * 3 + [0.4 + EPS])
    ties = torch.tensor([1.0, 1.0, 0.0])
    assert F.pf_ppo_weights(ties, "max_random", 2.0).tolist() == pytest.approx([0.4 + EPS, 0.4 + EPS, 0.1 + EPS])
    # every score equal: max_min keeps all of them
    assert F.pf_ppo_weights(torch.ones(3), "max_min", 2.0).tolist() == pytest.approx([1 + EPS] * 3)
    # integer scores are read as floats; an unknown method is refused
    assert F.pf_ppo_weights(torch.tensor([2, -1]), "pow", 3.0).tolist() == pytest.approx([8 + EPS, 1 + EPS])
    with pytest.raises(ValueError, match="reweight_method must be one of pow, max_min, max_random"):
        F.pf_ppo_weights(s, "top", 2.0)


def test_draw_frequencies_follow_the_weights():
    # 4000 responses of four scores: each score's share of the draw is its weight share
    s = torch.tensor([1.0, -2.0, 0.0, 3.0]).repeat_interleave(1000)
    rows = F.pf_ppo_resample(s, "pow", 2.0, torch.Generator().manual_seed(0))
    assert rows.shape == (4000,) and rows.dtype == torch.long
    share = torch.bincount(rows // 1000, minlength=4).float() / 4000
    expected = torch.tensor([1.0, 4.0, 0.0, 9.0]) / 14
    assert torch.allclose(share, expected, atol=0.025) and share[2] == 0  # a 0 score is (almost) never drawn
    extremes = F.pf_ppo_resample(s, "max_min", 2.0, torch.Generator().manual_seed(0))
    assert set((extremes // 1000).tolist()) == {1, 3}
    top = F.pf_ppo_resample(s, "max_random", 2.0, torch.Generator().manual_seed(0))
    share = torch.bincount(top // 1000, minlength=4).float() / 4000
    assert torch.allclose(share, torch.tensor([1, 1, 1, 4]) / 7, atol=0.025)


def test_resampling_is_seeded():
    s = torch.arange(8).float()
    a = F.pf_ppo_resample(s, "pow", 2.0, torch.Generator().manual_seed(3))
    b = F.pf_ppo_resample(s, "pow", 2.0, torch.Generator().manual_seed(3))
    c = F.pf_ppo_resample(s, "pow", 2.0, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def batch(scores) -> Batch:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    return Batch({"scores": torch.tensor(scores, dtype=torch.float32), "group_index": torch.tensor([0, 0, 1, 1]),
                  "response_mask": mask, "responses": torch.arange(12).view(4, 3)},
                 {"uid": ["a", "b", "c", "d"]})


def test_the_batch_is_replaced_row_by_row_after_the_advantages(pm):
    alg = build(pm, use_pf_ppo=True, pf_ppo={"reweight_method": "max_min"})
    plain = build(pm)
    b = alg.compute_advantages(batch([1.0, 0.0, 0.5, 0.5]))
    ref = plain.compute_advantages(batch([1.0, 0.0, 0.5, 0.5]))
    assert len(b) == 4
    # only the best (row 0) and the worst (row 1) are drawn: GRPO's advantages of the original batch go with them
    assert set(b["uid"]) <= {"a", "b"}
    for i, uid in enumerate(b["uid"]):
        j = "abcd".index(uid)
        assert torch.equal(b["responses"][i], ref["responses"][j])
        assert torch.equal(b["advantages"][i], ref["advantages"][j])
        assert b["scores"][i] == ref["scores"][j] and b["group_index"][i] == ref["group_index"][j]
    stats = alg.metrics(b)
    assert stats["pf_ppo/unique_ratio"] == len(set(b["uid"])) / 4
    assert stats["pf_ppo/score_mean_before"] == pytest.approx(0.5)


def test_the_draws_repeat_for_a_seed_and_across_a_resume(pm):
    def draws(alg, steps):
        return [alg.compute_advantages(batch([1.0, 0.2, 0.5, 0.7]))["uid"] for _ in range(steps)]

    first = draws(build(pm, use_pf_ppo=True), 6)
    assert first == draws(build(pm, use_pf_ppo=True), 6)
    assert len({tuple(d) for d in first}) > 1  # each step draws anew
    assert first != draws(build(pm, seed=8, use_pf_ppo=True), 6)
    half = build(pm, use_pf_ppo=True)
    draws(half, 3)
    resumed = build(pm, use_pf_ppo=True)
    resumed.load_state_dict(half.state_dict())
    assert draws(resumed, 3) == first[3:]
    # off: the batch is left as it is
    assert build(pm).compute_advantages(batch([1.0, 0.2, 0.5, 0.7]))["uid"] == ["a", "b", "c", "d"]


@pytest.mark.parametrize(("override", "message"), [
    ("algorithm.pf_ppo.reweight_method=top", "algorithm.pf_ppo.reweight_method: must be one of 'pow', 'max_min'"),
    ("algorithm.pf_ppo.weight_pow=-1", "algorithm.pf_ppo.weight_pow: Input should be greater than or equal to 0"),
    ("algorithm.pf_ppo.weight=2", "algorithm.pf_ppo.weight: unknown key"),
])
def test_bad_options_are_config_errors(pm, override, message):
    from rlx.validate import load_config

    with pytest.raises(ConfigError) as info:
        load_config(pm, preset="tiny", overrides=["algorithm.use_pf_ppo=true", override])
    assert message in str(info.value)


def test_a_ppo_step_trains_the_critic_and_the_actor_on_the_drawn_batch(tmp_path, one_thread):
    """One step of the tiny PPO run with PF-PPO: the drawn batch goes through the critic's and the actor's updates,
    and the step logs the draw."""
    from test_trainer_surface import make_trainer

    from rlx.plugins.loggers.jsonl import read_metrics

    trainer = make_trainer(tmp_path / "run", "algorithm.name=ppo", "algorithm.use_pf_ppo=true",
                           "algorithm.pf_ppo.reweight_method=max_random", "trainer.total_steps=1")
    trainer.fit()
    (row,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "actor/pg_loss" in r]
    assert 0 < row["pf_ppo/unique_ratio"] <= 1 and "critic/vf_loss" in row and "actor/pg_loss" in row
