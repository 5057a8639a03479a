"""The ``grpo`` algorithm: group-relative advantages and a clipped surrogate with KL to a reference.

For a prompt with n sampled responses and rewards r_1..r_n, each response's advantage is
A_i = (r_i - mean(r)) / (std(r) + eps)  (or r_i - mean(r) with ``norm_adv_by_std=false``, Dr. GRPO),
given to every token of the response. The actor minimises

    L = agg( max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)) )
        + kl_loss_coef * agg(KL(pi || pi_ref)) - entropy_coeff * agg(entropy)

with ratio = pi(token) / pi_old(token) and the KL estimated per token (k3, "low_var_kl", by default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.context import BuildContext

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch


OUTCOME_ESTIMATORS = ("grpo", "grpo_no_std", "rloo", "reinforce_plus_plus_baseline")


class GRPOOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    adv_estimator: str = Field(
        "grpo", description="Outcome advantage estimator: grpo, rloo, reinforce_plus_plus_baseline, or a plugin's.")
    norm_adv_by_std: bool = Field(True, description="Divide by the group's std (false: Dr. GRPO).")
    clip_ratio: float = Field(0.2, gt=0, description="PPO clip range for the probability ratio.")
    clip_ratio_low: float | None = Field(None, gt=0, description="Lower clip range (default clip_ratio).")
    clip_ratio_high: float | None = Field(None, gt=0, description="Upper clip range (DAPO clip-higher).")
    clip_ratio_c: float | None = Field(None, gt=1, description="Dual-clip bound for negative advantages.")
    policy_loss: Literal["vanilla", "gspo"] = Field("vanilla", description="Token or sequence ratio.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = Field("token-mean", description="Loss aggregation.")
    use_kl_loss: bool = Field(True, description="Add KL to the reference model as a loss term.")
    kl_loss_coef: float = Field(0.001, ge=0, description="Weight of the KL loss.")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = Field(
        "low_var_kl", description="KL estimator for the loss.")
    entropy_coeff: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")


class GRPOLoss:
    """The actor loss; a plain picklable object so process launchers can send it to workers."""

    def __init__(self, opts: GRPOOptions) -> None:
        self.opts = opts

    def __call__(self, outputs: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        from rlx.plugins.algorithms import functional as F

        o = self.opts
        log_probs, entropy = outputs["log_probs"], outputs["entropy"]  # (b, R)
        mask = mb["response_mask"].to(log_probs.dtype)
        # Normalise by the whole mini-batch's counts so that summing micro-batch gradients gives
        # exactly the mini-batch gradient.
        norm = {"num_tokens": mb.meta["minibatch_tokens"], "num_seqs": mb.meta["minibatch_seqs"],
                "max_len": mask.shape[1]}
        clip = {"clip_low": o.clip_ratio_low or o.clip_ratio, "clip_high": o.clip_ratio_high or o.clip_ratio}
        if o.policy_loss == "vanilla":
            clip["clip_ratio_c"] = o.clip_ratio_c
        pg_loss, metrics = F.POLICY_LOSSES[o.policy_loss](
            log_probs, mb["old_log_probs"], mb["advantages"], mask, agg_mode=o.loss_agg_mode, **clip, **norm)
        out = {f"actor/{k}": float(v) for k, v in metrics.items()}
        out["actor/pg_loss"] = float(pg_loss.detach()) * self._to_mean(mb, mask)
        out["actor/entropy"] = float(F.masked_mean(entropy.detach(), mask))
        loss = pg_loss
        if o.entropy_coeff:
            loss = loss - o.entropy_coeff * F.agg_loss(entropy, mask, o.loss_agg_mode, **norm)
        if o.use_kl_loss:
            kl = F.kl_penalty(log_probs, mb["ref_log_probs"], o.kl_loss_type)  # (b, R)
            loss = loss + o.kl_loss_coef * F.agg_loss(kl, mask, o.loss_agg_mode, **norm)
            out["actor/kl_loss"] = float(F.masked_mean(kl.detach(), mask))
        return loss, out

    @staticmethod
    def _to_mean(mb: Batch, mask: torch.Tensor) -> float:
        """Factor turning this micro-batch's share of the loss into a value the backend can average.

        The backend averages metrics weighted by each micro-batch's token count, and the shares add
        up to the mini-batch loss in every aggregation mode, so scaling by tokens is exact for all.
        """
        return mb.meta["minibatch_tokens"] / max(float(mask.sum()), 1.0)


class GRPO:
    needs_critic = False

    def __init__(self, opts: GRPOOptions, ctx: BuildContext) -> None:
        from rlx.plugins.algorithms import functional as F

        self.opts = opts
        self.needs_ref = opts.use_kl_loss
        name = opts.adv_estimator
        if name == "grpo" and not opts.norm_adv_by_std:
            name = "grpo_no_std"
        # Outcome estimators: fn(scores (B,), group_index (B,), response_mask (B, R)) -> (adv, returns).
        if name in OUTCOME_ESTIMATORS:
            self.estimator = F.ADVANTAGE_ESTIMATORS[name]
        else:
            from rlx.registry import get_plugin_manager

            self.estimator = (ctx.plugins or get_plugin_manager()).get("advantage", name).load_factory()

    def compute_advantages(self, batch: Batch) -> Batch:
        import torch

        mask = batch["response_mask"].float()  # (B, R)
        adv, returns = self.estimator(batch["scores"], batch["group_index"], mask)
        batch.update(advantages=adv.to(torch.float32), returns=returns.to(torch.float32))
        return batch

    def policy_loss_fn(self) -> GRPOLoss:
        return GRPOLoss(self.opts)

    def metrics(self, batch: Batch) -> dict[str, float]:
        from rlx.plugins.algorithms import functional as F

        mask = batch["response_mask"].float()
        adv = batch["advantages"]
        valid = adv[mask.bool()]
        return {"critic/advantages/mean": float(F.masked_mean(adv, mask)),
                "critic/advantages/max": float(valid.max()) if valid.numel() else 0.0,
                "critic/advantages/min": float(valid.min()) if valid.numel() else 0.0}


def build(options: GRPOOptions | None, ctx: BuildContext) -> GRPO:
    return GRPO(options or GRPOOptions(), ctx)


@hookimpl
def rlx_algorithms() -> list[Component]:
    return [Component(kind="algorithm", name="grpo", factory=build, config_model=GRPOOptions,
                      summary="GRPO: group-normalised advantages, clipped surrogate, KL loss to a reference.")]
