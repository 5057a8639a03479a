"""What every built-in algorithm shares: the options, the actor and critic losses, and one
policy-gradient algorithm class that the algorithm modules (``grpo``, ``rloo``, ``ppo``, ...)
configure with their own defaults.

One step of the algorithm, on a batch of B responses (R response tokens, right-padded)::

    s_i      = score_i + overlong_penalty(len_i)                          (shaped scores, (B,))
    r_it     = s_i on the last real token, 0 elsewhere                    (token-level scores)
             - beta * KL_t(pi_old || pi_ref)   if use_kl_in_reward        (token-level rewards)
    A, G     = estimator(EstimatorInputs(scores = sum_t r_it, token_level_rewards = r, ...))
    actor:  L = agg(w * PPO-clip(ratio, A)) + kl_loss_coef * agg(KL(pi || pi_ref)) - entropy_coeff * agg(H)
            w = min(exp(old_log_prob - rollout_log_prob), tis_cap) (detached) when tis_cap is set, the
                rollout_correction weights (token / sequence IS, rejection) when that is set, else 1;
            PPO-clip is the default policy loss (policy_loss: gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, cispo)
    critic: L = agg(0.5 * max((V - G)^2, (clip(V, V_old +- c) - G)^2))    (when the estimator needs values)

The tensor math is :mod:`rlx.plugins.algorithms.functional`; this module imports torch only when
an algorithm is built or run, so listing plugins stays fast.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlx.batch import trained_mask
from rlx.context import BuildContext
from rlx.errors import UserError, did_you_mean
from rlx.protocols import AlgorithmNeeds, estimator_requires

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch
    from rlx.records import LossContext
    from rlx.registry import PluginManager

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl", "abs", "kl", "mse", "k1+", "k3+", "low_var_kl+"]
PolicyLoss = Literal["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "bypass_mode"]
# Policy losses whose ratio or gate is per sequence (or whose paper aggregates per sequence): their default
# loss_agg_mode is seq-mean-token-mean, as verl's; an explicit loss_agg_mode still wins.
SEQUENCE_LEVEL_LOSSES = frozenset({"gspo", "sapo", "geo_mean"})
# The options of each policy loss beyond the clip ranges: keyword arguments of its function in functional.py.
POLICY_LOSS_KNOBS: dict[str, tuple[str, ...]] = {
    "sapo": ("tau_pos", "tau_neg"),
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
}
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class KLControlOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: beta = kl_coef always; adaptive: beta follows target_kl (Ziegler et al.).")
    kl_coef: float = Field(0.001, ge=0, le=100, description="beta, the weight of the KL penalty in the reward (initial "
                           "value when adaptive).")
    target_kl: float = Field(0.1, gt=0, le=100, description="Adaptive: the per-token KL the controller steers towards.")
    horizon: int = Field(10000, gt=0, le=10**12,
                         description="Adaptive: beta changes by at most 20% per `horizon` sequences.")


ROLLOUT_RS_MODES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                    "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")  # as functional.ROLLOUT_RS_MODES


def parse_rejection(modes: str, thresholds: str | float | None) -> list[tuple[str, float | None, float]]:
    """verl's ``rollout_rs`` (comma-separated modes) and ``rollout_rs_threshold`` (one bound shared by every mode, or
    one per mode, comma-separated; a k1 mode takes ``LOWER_UPPER`` ratio bounds, or ``UPPER`` with lower = 1 / UPPER)
    -> ``(mode, lower, upper)`` triples. ValueError on anything else."""
    names = list(dict.fromkeys(m.strip() for m in modes.split(",") if m.strip()))
    if not names:
        raise ValueError("rollout_rs names no mode")
    for name in names:
        if name not in ROLLOUT_RS_MODES:
            raise ValueError(f"rollout_rs mode {name!r} is not one of {', '.join(ROLLOUT_RS_MODES)}"
                             f"{did_you_mean(name, ROLLOUT_RS_MODES)}")
    if thresholds is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold (e.g. 0.5_2.0 for a k1 mode, 0.01 for k2 / k3)")
    specs = [thresholds] if isinstance(thresholds, int | float) else [p.strip() for p in str(thresholds).split(",")]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(f"rollout_rs_threshold gives {len(specs)} bounds for {len(names)} rollout_rs modes: give one "
                         "for all, or one per mode")
    out: list[tuple[str, float | None, float]] = []
    for name, spec in zip(names, specs, strict=True):
        text = str(spec)
        try:
            if name.endswith("k1"):
                low_text, _, high_text = text.partition("_") if "_" in text else ("", "", text)
                upper = float(high_text)
                lower = float(low_text) if low_text else (1.0 / upper if upper > 0 else -1.0)
            else:
                if "_" in text:
                    raise ValueError(f"rollout_rs mode {name} takes one upper bound, not a band ({text!r})")
                lower, upper = None, float(text)
        except ValueError as err:
            if "takes one upper bound" in str(err):
                raise
            raise ValueError(f"rollout_rs_threshold {text!r} for {name} is not a number (or LOWER_UPPER)") from None
        if not (upper > 0 and (lower is None or lower > 0)) or not all(map(math.isfinite, [upper, lower or 1.0])):
            raise ValueError(f"rollout_rs_threshold {text!r} for {name}: bounds must be positive and finite")
        if lower is not None and lower > upper:
            raise ValueError(f"rollout_rs_threshold {text!r} for {name}: the lower bound is above the upper one")
        out.append((name, lower, upper))
    return out


class RolloutCorrectionOptions(BaseModel):
    """verl's ``algorithm.rollout_correction``: weights and rejection for a rollout engine whose probabilities differ
    from the trainer's (computed on the whole batch from old and rollout log-probs)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    rollout_is: Literal["token", "sequence", "geometric"] | None = Field(
        None, description="Importance weights pi_old / pi_rollout per token, their product per sequence, or their "
        "geometric mean per sequence (truncated at rollout_is_threshold); null: none.")
    rollout_is_threshold: float = Field(2.0, gt=0, le=1e6, description="Upper truncation of the weights.")
    rollout_is_batch_normalize: bool = Field(False, description="Divide the weights by their batch mean.")
    rollout_rs: str | None = Field(
        None, description=f"Rejection: comma-separated modes of {', '.join(ROLLOUT_RS_MODES)}; a token or sequence "
        "whose statistic leaves its bounds leaves the response mask (no loss, advantage, KL or entropy term).")
    rollout_rs_threshold: str | float | None = Field(
        None, description="Bounds of rollout_rs: one for all modes or one per mode; k1 modes LOWER_UPPER ratios "
        "(e.g. 0.5_2.0), k2 / k3 an upper bound.")
    bypass_mode: bool = Field(
        False, description="verl's bypass mode: pi_old = pi_rollout (the engine's log-probs; the old-log-prob pass "
        "is skipped), the correction computed in the loss between the trained policy and pi_rollout; the policy "
        "loss is then algorithm.policy_loss=bypass_mode.")
    loss_type: Literal["ppo_clip", "reinforce"] = Field(
        "ppo_clip", description="Bypass mode's loss: ppo_clip (the ratio pi / pi_rollout, clipped; IS weights only "
        "logged) or reinforce (-w A logp with the truncated IS weights w of rollout_is).")

    @model_validator(mode="after")
    def _check_rejection(self) -> RolloutCorrectionOptions:
        if self.rollout_rs is not None:
            parse_rejection(self.rollout_rs, self.rollout_rs_threshold)
        return self

    @property
    def active(self) -> bool:
        """Decoupled correction: weights / rejection computed on the whole batch from pi_old and pi_rollout."""
        return not self.bypass_mode and (self.rollout_is is not None or self.rollout_rs is not None)

    def rejection(self) -> list[tuple[str, float | None, float]] | None:
        return None if self.rollout_rs is None else parse_rejection(self.rollout_rs, self.rollout_rs_threshold)


class PFPPOOptions(BaseModel):
    """verl's ``algorithm.pf_ppo``: how PF-PPO (``use_pf_ppo``) weighs each response when it resamples the batch."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    reweight_method: Literal["pow", "max_min", "max_random"] = Field(
        "pow", description="pow: weight |score| ** weight_pow; max_min: only the batch's best and worst scored "
        "responses (weight 1, others ~0); max_random: 0.4 for the best scored, 0.1 for the others.")
    weight_pow: float = Field(2.0, ge=0, le=100, description="The power of the pow method.")


class AlgorithmOptions(BaseModel):
    """Options common to every built-in algorithm; each algorithm module changes some defaults.

    Numbers must be finite; coefficients and clip ranges have upper bounds far beyond any useful value, so
    that a typo (``kl_loss_coef=1e308``) is an error here and not NaN losses later."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # -- advantages
    adv_estimator: str = Field(
        "grpo", description="Advantage estimator: grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, "
        "remax, gae, opo, gpg, grpo_passk, grpo_vectorized, rloo_vectorized, optimal_token_baseline, "
        "tir_optimal_token_baseline, or one a plugin registers (rlx plugins list shows kind 'advantage').")
    norm_adv_by_std: bool = Field(True, description="grpo: divide by the group's std (false: Dr. GRPO); remax: "
                                  "divide by the batch's root mean square (false: verl's unscaled r - r_greedy).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor (gae, reinforce_plus_plus).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (bias-variance trade-off of gae).")
    estimator_options: dict[str, Any] = Field(
        default_factory=dict, description="Free-form options handed to a plugin estimator (EstimatorInputs.options).")
    # -- policy loss
    policy_loss: PolicyLoss = Field(
        "vanilla", description="vanilla: PPO clip on the token ratio; gspo: on the sequence-level ratio; sapo: a "
        "smooth gate (tau_pos, tau_neg); gpg: -A logp; clip_cov / kl_cov: detach / KL-penalise high-covariance tokens; "
        "geo_mean: GMPO's geometric-mean ratio; cispo: clipped, detached importance weight times -A logp.")
    tau_pos: float = Field(1.0, gt=0, le=1000, description="sapo: gate temperature of positive-advantage tokens "
                           "(verl: actor.tau_pos).")
    tau_neg: float = Field(1.05, gt=0, le=1000, description="sapo: gate temperature of other tokens (verl: "
                           "actor.tau_neg).")
    clip_cov_ratio: float = Field(2e-4, gt=0, le=1, description="clip_cov: the most tokens detached, as a "
                                  "fraction of a micro-batch's tokens.")
    clip_cov_lb: float = Field(1.0, ge=-1e6, le=1e6, description="clip_cov: only tokens whose covariance is above "
                               "this are detached.")
    clip_cov_ub: float = Field(5.0, ge=-1e6, le=1e6, description="clip_cov: ... and below this.")
    kl_cov_ratio: float = Field(2e-4, gt=0, le=1, description="kl_cov: the fraction of a micro-batch's tokens, "
                                "those of largest covariance, given the KL penalty.")
    ppo_kl_coef: float = Field(0.1, ge=0, le=100, description="kl_cov: weight of |logp - logp_old| on those tokens.")
    clip_ratio: float = Field(0.2, gt=0, le=10, description="PPO clip range for the probability ratio.")
    clip_ratio_low: float | None = Field(None, gt=0, le=10, description="Lower clip range (default clip_ratio).")
    clip_ratio_high: float | None = Field(
        None, gt=0, le=10, description="Upper clip range (default clip_ratio; DAPO's clip-higher uses 0.28).")
    clip_ratio_c: float | None = Field(
        3.0, gt=1, le=1000, description="Dual-clip: bound the loss of negative-advantage tokens at -A * c (as verl; "
        "null: off). vanilla only.")
    loss_agg_mode: LossAggMode = Field(
        "token-mean", description="How per-token losses become one number (policy_loss=gspo: "
        "seq-mean-token-mean unless set).")
    entropy_coeff: float = Field(0.0, ge=0, le=100, description="Weight of the entropy bonus.")
    tis_cap: float | None = Field(
        None, gt=0, le=1e6, description="Truncated importance sampling (verl: tis_imp_ratio_cap): each token's policy "
        "loss is multiplied by min(exp(old_log_prob - rollout_log_prob), tis_cap), correcting for a rollout engine "
        "whose probabilities differ from the trainer's (2 is usual; null: off).")
    rollout_correction: RolloutCorrectionOptions = Field(
        default_factory=RolloutCorrectionOptions, description="verl's rollout correction: sequence or token "
        "importance weights and rejection of tokens / sequences (docs/algorithms.md).")
    use_pf_ppo: bool = Field(
        False, description="PF-PPO (Policy Filtration for PPO, verl's use_pf_ppo): after the advantages, the batch is "
        "replaced by as many responses drawn from it with replacement, each with probability proportional to a "
        "weight of its score (pf_ppo.reweight_method), seeded from trainer.seed and the step; the critic and the "
        "actor train on the drawn batch. verl applies it with adv_estimator=gae only.")
    pf_ppo: PFPPOOptions = Field(default_factory=PFPPOOptions, description="PF-PPO's weights (use_pf_ppo).")
    # -- KL to the reference policy
    use_kl_loss: bool = Field(True, description="Add KL(pi || pi_ref) as a loss term (GRPO style).")
    kl_loss_coef: float = Field(0.001, ge=0, le=100, description="Weight of the KL loss.")
    kl_loss_type: KLEstimator = Field("low_var_kl", description="KL estimator of the loss (low_var_kl = k3).")
    use_kl_in_reward: bool = Field(False, description="Subtract beta * KL(pi_old || pi_ref) from the token rewards "
                                   "(PPO/RLHF style).")
    kl_penalty: KLEstimator = Field("k1", description="KL estimator of the reward penalty.")
    kl_ctrl: KLControlOptions = Field(default_factory=KLControlOptions, description="beta of the reward penalty.")
    # -- DAPO
    filter_groups: bool = Field(
        False, description="Dynamic sampling: drop prompts whose responses all scored the same, generate more.")
    max_num_gen_batches: int = Field(
        10, ge=0, le=10**6, description="Dynamic sampling: most generation batches per step (0: no limit).")
    overlong_buffer_len: int | None = Field(
        0, ge=0, le=2**20, description="Overlong shaping: responses longer than data.max_response_length - this lose "
        "reward linearly (0: off; null: a quarter of data.max_response_length).")
    overlong_penalty_factor: float = Field(1.0, ge=0, le=1000, description="Overlong shaping: the most reward lost.")

    @model_validator(mode="after")
    def _gspo_aggregates_per_sequence(self) -> AlgorithmOptions:
        # GSPO's and SAPO's ratios are per token but verl always aggregates their loss per sequence, and
        # GMPO's loss is per sequence; here an explicit loss_agg_mode still wins, but the default follows the loss.
        if self.policy_loss in SEQUENCE_LEVEL_LOSSES and "loss_agg_mode" not in self.model_fields_set:
            self.loss_agg_mode = "seq-mean-token-mean"
        return self

    @model_validator(mode="after")
    def _one_rollout_correction(self) -> AlgorithmOptions:
        rc = self.rollout_correction
        if self.tis_cap is not None and (rc.active or rc.bypass_mode or self.policy_loss == "bypass_mode"):
            raise ValueError("tis_cap and rollout_correction both correct for the rollout engine: use one "
                             "(tis_cap=C is rollout_correction.rollout_is=token with rollout_is_threshold=C)")
        return self

    @model_validator(mode="after")
    def _bypass_mode(self) -> AlgorithmOptions:
        # verl turns bypass mode on with rollout_correction.bypass_mode=true (its loss becomes loss_mode=bypass_mode);
        # here either spelling turns on both, and a third loss beside bypass mode is an error, not replaced.
        rc = self.rollout_correction
        if rc.bypass_mode and self.policy_loss not in ("vanilla", "bypass_mode"):
            raise ValueError(f"rollout_correction.bypass_mode=true has its own policy loss (PPO clip or REINFORCE: "
                             f"rollout_correction.loss_type), so policy_loss={self.policy_loss} would not be used: "
                             "leave policy_loss at vanilla (or set it to bypass_mode), or set bypass_mode=false.")
        if rc.bypass_mode:
            self.policy_loss = "bypass_mode"
        elif self.policy_loss == "bypass_mode":
            rc.bypass_mode = True
        return self

    @model_validator(mode="after")
    def _cov_band(self) -> AlgorithmOptions:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub ({self.clip_cov_ub}): "
                             "clip_cov detaches tokens whose covariance lies between them (verl: 1 and 5).")
        return self

    def policy_loss_knobs(self) -> dict[str, Any]:
        """The options of ``policy_loss`` beyond the clip ranges, as keyword arguments of its function."""
        if self.policy_loss == "bypass_mode":
            rc = self.rollout_correction
            return {"loss_type": rc.loss_type, "rollout_is": rc.rollout_is, "rollout_is_threshold":
                    rc.rollout_is_threshold, "rollout_is_batch_normalize": rc.rollout_is_batch_normalize,
                    "rejection": rc.rejection()}
        return {name: getattr(self, name) for name in POLICY_LOSS_KNOBS.get(self.policy_loss, ())}

    def plugin_problems(self, pm: PluginManager) -> list[str]:
        """Config problems with the components these options name (called by config validation)."""
        problem = unknown_estimator(pm, self.adv_estimator)
        return [f"adv_estimator: {problem}"] if problem else []


def unknown_estimator(pm: PluginManager, name: str) -> str | None:
    """What is wrong with an estimator name, or None if a plugin provides it."""
    names = pm.names("advantage")
    if name in names:
        return None
    return (f"no advantage estimator named {name!r}.{did_you_mean(name, names)} Valid estimators: "
            f"{', '.join(names)} (plugins add more: `rlx plugins list` shows kind 'advantage').")


def group_size_problem(opts: AlgorithmOptions, n: int) -> tuple[str, str] | None:
    """``(what is wrong, how to fix it)`` when the options cannot learn from ``rollout.n`` = ``n``
    responses per prompt (group-relative advantages or dynamic sampling with n = 1), else None."""
    from rlx.plugins.algorithms.estimators import GROUP_RELATIVE

    if n > 1:
        return None
    if opts.adv_estimator in GROUP_RELATIVE:
        return (f"algorithm.adv_estimator={opts.adv_estimator} compares each response with the other responses to "
                f"the same prompt, but rollout.n={n} samples one response per prompt: every advantage would be "
                "exactly 0 and the policy would never learn.",
                "Set rollout.n to 2 or more (4-16 is usual), or use an estimator with another baseline: "
                "algorithm.adv_estimator=reinforce_plus_plus, --algorithm remax or --algorithm ppo.")
    if opts.filter_groups:
        return (f"algorithm.filter_groups=true (dynamic sampling) drops prompts whose responses all scored the "
                f"same, and with rollout.n={n} every prompt has a single response, so every prompt would be dropped.",
                "Set rollout.n to 2 or more, or algorithm.filter_groups=false.")
    return None


class ActorLoss:
    """The actor loss; a plain picklable object so process launchers can send it to workers."""

    def __init__(self, opts: AlgorithmOptions) -> None:
        self.opts = opts
        # Without an entropy bonus the entropy is only logged: the backend need not differentiate it.
        self.needs_entropy_grad = bool(opts.entropy_coeff)

    def __call__(self, outputs: dict[str, torch.Tensor], mb: Batch,
                 ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        from rlx.plugins.algorithms import functional as F

        o = self.opts
        log_probs, entropy = outputs["log_probs"], outputs["entropy"]  # (b, R)
        mask = trained_mask(mb).to(log_probs.dtype)
        # Normalise by the whole mini-batch's counts so that summing micro-batch gradients gives
        # exactly the mini-batch gradient.
        norm = minibatch_norm(ctx, mask)
        clip = {"clip_low": o.clip_ratio_low or o.clip_ratio, "clip_high": o.clip_ratio_high or o.clip_ratio,
                "clip_ratio_c": o.clip_ratio_c}
        # On-policy steps skip the old-log-prob pass (actor.recompute_old_log_prob): this forward runs the policy
        # that pass would have, so its log-probs, detached, are the old ones (ratio 1, the same gradient).
        from_update = ctx.old_from_update
        old_log_probs = log_probs.detach() if from_update else mb["old_log_probs"]
        tis: dict[str, float] = {}
        weights = None
        if o.tis_cap is not None:
            weights, tis = F.tis_weights(old_log_probs, mb["rollout_log_probs"], mask, o.tis_cap)
        elif "rollout_is_weights" in mb:  # rollout_correction, computed on the whole batch
            weights = mb["rollout_is_weights"].to(log_probs.dtype)
        pg_loss, metrics = F.POLICY_LOSSES[o.policy_loss](
            log_probs, old_log_probs, mb["advantages"], mask, agg_mode=o.loss_agg_mode, token_weights=weights,
            **clip, **norm, **o.policy_loss_knobs())
        # Keys that name their own section (bypass mode's rollout_corr/...) keep it; the rest are the actor's.
        out = {(k if "/" in k else f"actor/{k}"): float(v) for k, v in {**metrics, **tis}.items()}
        if from_update and "rollout_log_probs" in mb:
            # What PolicyGradient.metrics logs from the old-log-prob pass otherwise; the update averages metrics
            # over tokens, so the mean is exact and the maximum cannot be logged.
            diff_mean, _ = F.logprob_diff(mb["rollout_log_probs"], old_log_probs, mask)
            out["rollout/logprob_diff_mean"] = diff_mean
        out["actor/pg_loss"] = float(pg_loss.detach()) * share_to_mean(ctx, mask)
        out["actor/entropy"] = float(F.masked_mean(entropy.detach(), mask))
        loss = pg_loss
        if o.entropy_coeff:
            loss = loss - o.entropy_coeff * F.agg_loss(entropy, mask, o.loss_agg_mode, **norm)
        if o.use_kl_loss:
            kl = F.kl_penalty(log_probs, mb["ref_log_probs"], o.kl_loss_type, mask)  # (b, R), 0 at padding
            loss = loss + o.kl_loss_coef * F.agg_loss(kl, mask, o.loss_agg_mode, **norm)
            out["actor/kl_loss"] = float(F.masked_mean(kl.detach(), mask))
        return loss, out


class CriticLoss:
    """The critic's clipped value loss (token-mean over the mini-batch); picklable."""

    def __init__(self, cliprange_value: float | None) -> None:
        self.cliprange_value = cliprange_value

    def __call__(self, outputs: dict[str, torch.Tensor], mb: Batch,
                 ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        from rlx.plugins.algorithms import functional as F

        values = outputs["values"]  # (b, R)
        mask = trained_mask(mb).to(values.dtype)
        norm = minibatch_norm(ctx, mask)
        loss, metrics = F.value_loss(values, mb["values"], mb["returns"], mask, clip_range=self.cliprange_value,
                                     agg_mode="token-mean", **norm)
        return loss, {"critic/vf_loss": metrics["vf_loss"] * share_to_mean(ctx, mask),
                      "critic/vf_clipfrac": metrics["vf_clipfrac"],
                      "critic/vpred_mean": float(F.masked_mean(values.detach(), mask))}


def minibatch_norm(ctx: LossContext, mask: torch.Tensor) -> dict[str, Any]:
    """The mini-batch's global token and sequence counts (the shared step's :class:`LossContext`), for
    ``agg_loss``.

    ``max_len`` (the constant of ``seq-mean-token-sum-norm``) is the configured response budget the
    trainer passes on (``rollout.max_tokens``), not the padded width, which changes from step to step; the
    micro-batch's width when none was given.
    """
    # A mini-batch can hold no trained token (every one rejected by rollout_correction, or tool output only):
    # its loss is then 0 over a count of 1.
    return {"num_tokens": max(ctx.global_tokens, 1.0), "num_seqs": max(ctx.global_seqs, 1.0),
            "max_len": int(ctx.max_response_length or mask.shape[1])}


def share_to_mean(ctx: LossContext, mask: torch.Tensor) -> float:
    """Factor turning this micro-batch's share of the loss into a value the backend can average.

    The backend averages metrics weighted by each micro-batch's token count, and the shares add
    up to the mini-batch loss in every aggregation mode, so scaling by tokens is exact for all.
    """
    return ctx.global_tokens / max(float(mask.sum()), 1.0)


class PolicyGradient:
    """The policy-gradient algorithm behind ``grpo``, ``rloo``, ``reinforce_plus_plus``, ``remax``,
    ``dapo`` and ``ppo``: they differ only in their option defaults.

    What it asks of the trainer follows from the options: a reference model when a KL term is on,
    a critic when the estimator requires values, a greedy baseline when it requires baseline scores.
    """

    def __init__(self, opts: AlgorithmOptions, ctx: BuildContext) -> None:
        from rlx.plugins.algorithms import functional as F
        from rlx.plugins.algorithms.estimators import GROUP_RELATIVE
        from rlx.registry import get_plugin_manager

        self.opts = opts
        pm = ctx.plugins or get_plugin_manager()
        problem = unknown_estimator(pm, opts.adv_estimator)
        if problem:
            raise UserError(f"algorithm.adv_estimator: {problem}")
        self.estimator = pm.get("advantage", opts.adv_estimator).load_factory()
        needs = estimator_requires(self.estimator)
        self.needs_critic = "values" in needs
        self.needs_greedy_baseline = "baseline_scores" in needs
        self.needs_sum_pi_squared = "sum_pi_squared" in needs
        self.needs_ref = opts.use_kl_loss or opts.use_kl_in_reward
        # The loss is the only reader of old log-probs unless the reward penalty needs them before the advantages.
        # Rollout correction's weights come from the old log-probs of the whole batch, before the update; in bypass
        # mode the old log-probs are the rollout engine's.
        bypass = opts.rollout_correction.bypass_mode
        if bypass and self.needs_sum_pi_squared:
            raise UserError(f"algorithm.adv_estimator={opts.adv_estimator} needs sum_pi_squared from the old-log-prob "
                            "pass, which bypass mode (algorithm.rollout_correction.bypass_mode) skips.",
                            "Set bypass_mode=false or use another estimator.")
        self.old_log_probs_from_update = not (opts.use_kl_in_reward or opts.rollout_correction.active or bypass
                                              or self.needs_sum_pi_squared)
        self.group_relative = opts.adv_estimator in GROUP_RELATIVE
        self.equal_score_steps = 0  # steps in which every group of the batch scored the same
        self.filter_groups = opts.filter_groups
        self.max_num_gen_batches = opts.max_num_gen_batches
        self.stats: dict[str, float] = {}  # the last compute_advantages' statistics
        # PF-PPO draws its rows with a generator seeded from trainer.seed and the number of draws so far (saved in
        # checkpoints), so a run and its resumption draw the same rows.
        self.pf_ppo_seed = ctx.config.trainer.seed if ctx.config is not None else 0
        self.pf_ppo_draws = 0
        # What the trainer reads (the attributes above stay for code written against rlx 0.1).
        self.needs = AlgorithmNeeds(ref=self.needs_ref, critic=self.needs_critic,
                                    greedy_baseline=self.needs_greedy_baseline, filter_groups=self.filter_groups,
                                    max_gen_batches=self.max_num_gen_batches,
                                    old_from_update=self.old_log_probs_from_update, old_from_rollout=bypass,
                                    sum_pi_squared=self.needs_sum_pi_squared)
        k = opts.kl_ctrl
        self.kl_ctrl: F.FixedKLController | F.AdaptiveKLController = (
            F.AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon) if k.type == "adaptive"
            else F.FixedKLController(k.kl_coef))
        cfg = ctx.config
        if self.needs_sum_pi_squared and cfg is not None:
            if cfg.backend.name == "megatron":
                raise UserError(f"algorithm.adv_estimator={opts.adv_estimator} needs sum_pi_squared (the sum over the "
                                "vocabulary of the squared probabilities), which the megatron backend does not "
                                "compute.", "Use backend.name=torch, fsdp or fsdp2, or another estimator.")
            if cfg.actor.ulysses_sequence_parallel_size > 1:
                raise UserError(f"algorithm.adv_estimator={opts.adv_estimator} needs sum_pi_squared, which is not "
                                "computed with Ulysses sequence parallelism.",
                                "Set actor.ulysses_sequence_parallel_size=1 or use another estimator.")
        problem = group_size_problem(opts, cfg.rollout.n) if cfg is not None else None
        if problem:
            raise UserError(*problem)
        self.max_response_length = cfg.data.max_response_length if cfg is not None else None
        self.cliprange_value = cfg.critic.cliprange_value if cfg is not None else 0.5
        self.overlong_buffer_len = opts.overlong_buffer_len
        if self.overlong_buffer_len is None or self.overlong_buffer_len > 0:
            if self.max_response_length is None:
                raise UserError("algorithm.overlong_buffer_len needs data.max_response_length.")
            if self.overlong_buffer_len is None:
                self.overlong_buffer_len = max(1, self.max_response_length // 4)
            if self.overlong_buffer_len > self.max_response_length:
                raise UserError(f"algorithm.overlong_buffer_len={self.overlong_buffer_len} is larger than "
                                f"data.max_response_length={self.max_response_length}.",
                                "Use a buffer shorter than the longest response, or 0 to turn shaping off.")

    # -- rewards ----------------------------------------------------------------------------
    def _shaped(self, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Scores plus the DAPO overlong penalty (when on); (B,) float32."""
        from rlx.plugins.algorithms import functional as F

        scores = scores.float()
        if not self.overlong_buffer_len:
            return scores
        assert self.max_response_length is not None
        return scores + F.overlong_penalty(lengths, max_len=self.max_response_length,
                                           buffer_len=self.overlong_buffer_len,
                                           penalty_factor=self.opts.overlong_penalty_factor).float()

    def shaped_scores(self, batch: Batch) -> torch.Tensor:
        return self._shaped(batch["scores"], batch["response_mask"].sum(-1))

    def keep_rows(self, batch: Batch) -> torch.Tensor:
        """Dynamic sampling: (B,) bool, True for the rows of groups whose shaped scores differ."""
        from rlx.plugins.algorithms import functional as F

        return ~F.group_all_equal(self.shaped_scores(batch), batch["group_index"])

    # -- advantages -------------------------------------------------------------------------
    def compute_advantages(self, batch: Batch) -> Batch:
        import torch

        from rlx.plugins.algorithms import functional as F
        from rlx.protocols import EstimatorInputs

        if self.opts.tis_cap is not None and "rollout_log_probs" not in batch:
            raise UserError("algorithm.tis_cap corrects the actor loss with the rollout engine's log-probs, but this "
                            "rollout engine returns none (no rollout_log_probs in its batch).",
                            "Use an engine that returns them (hf, vllm, sglang) or set algorithm.tis_cap=null.")
        rc = self.opts.rollout_correction
        if (rc.active or rc.bypass_mode) and "rollout_log_probs" not in batch:
            raise UserError("algorithm.rollout_correction weights the actor loss with the rollout engine's "
                            "log-probs, but this rollout engine returns none (no rollout_log_probs in its batch).",
                            "Use an engine that returns them (hf, vllm, sglang) or leave algorithm.rollout_correction "
                            "out.")
        mask = trained_mask(batch).float()  # (B, R)
        scores = self.shaped_scores(batch)  # (B,)
        token_scores = F.scores_to_token_rewards(scores, mask)  # (B, R)
        stats: dict[str, float] = {}
        if self.opts.use_kl_in_reward:
            beta = self.kl_ctrl.value
            rewards, mean_kl = F.apply_kl_in_reward(token_scores, batch["old_log_probs"], batch["ref_log_probs"],
                                                    mask, beta, self.opts.kl_penalty)
            self.kl_ctrl.update(mean_kl, n_steps=len(batch))
            stats.update({"actor/reward_kl_penalty": mean_kl, "actor/reward_kl_coef": beta})
        else:
            rewards = token_scores
        if rc.active:
            # As verl, before the advantages: a rejected token leaves the trained mask (rlx.batch.trained_mask), so
            # it has no advantage, no loss, KL or entropy term and is not counted in the losses' denominators.
            weights, keep, rc_metrics = F.rollout_correction_weights(
                batch["old_log_probs"], batch["rollout_log_probs"], mask, rollout_is=rc.rollout_is,
                threshold=rc.rollout_is_threshold, batch_normalize=rc.rollout_is_batch_normalize,
                rejection=rc.rejection())
            if rc.rollout_rs is not None:
                batch.update(rejection_mask=keep.long())
                mask = keep.float()
            if rc.rollout_is is not None:
                batch.update(rollout_is_weights=weights.float())
            stats.update({f"rollout_corr/{k}": v for k, v in rc_metrics.items()})
        baseline = None
        if "baseline_scores" in batch:
            baseline = self._shaped(batch["baseline_scores"], batch["baseline_response_length"])
        o = self.opts
        inputs = EstimatorInputs(
            response_mask=mask, scores=rewards.sum(-1), token_level_rewards=rewards,
            group_index=batch["group_index"], values=batch.tensors.get("values"), baseline_scores=baseline,
            gamma=o.gamma, lam=o.lam, norm_adv_by_std=o.norm_adv_by_std, options=dict(o.estimator_options),
            batch=batch, old_log_probs=batch.tensors.get("old_log_probs"),
            sum_pi_squared=batch.tensors.get("sum_pi_squared"),
            rollout_is_weights=batch.tensors.get("rollout_is_weights"))
        advantages, returns = self.estimator(inputs)
        for name, t in (("advantages", advantages), ("returns", returns)):
            if tuple(t.shape) != tuple(mask.shape):
                raise RuntimeError(f"advantage estimator {o.adv_estimator!r} returned {name} of shape "
                                   f"{tuple(t.shape)}; expected (B, R) = {tuple(mask.shape)}")
        valid = mask.bool()
        zero = torch.zeros((), dtype=torch.float32)
        batch.update(shaped_scores=scores, token_level_scores=token_scores, token_level_rewards=rewards,
                     advantages=torch.where(valid, advantages.float(), zero),
                     returns=torch.where(valid, returns.float(), zero))
        if o.use_pf_ppo:
            stats.update(self._pf_ppo_resample(batch))
        self.stats = stats  # this step's, for metrics()
        return batch

    def _pf_ppo_resample(self, batch: Batch) -> dict[str, float]:
        """PF-PPO, as verl: the batch's rows replaced, in place, by B rows drawn with replacement with probabilities
        proportional to :func:`~rlx.plugins.algorithms.functional.pf_ppo_weights` of the sequence scores
        (``token_level_scores`` summed: the shaped scores, before any KL penalty)."""
        import torch

        from rlx.plugins.algorithms import functional as F

        p = self.opts.pf_ppo
        gen = torch.Generator().manual_seed((self.pf_ppo_seed * 1_000_003 + self.pf_ppo_draws) % (2**63 - 1))
        self.pf_ppo_draws += 1
        scores = batch["token_level_scores"].sum(-1)
        rows = F.pf_ppo_resample(scores, p.reweight_method, p.weight_pow, gen)
        drawn = batch.index(rows)
        batch.tensors, batch.non_tensors = drawn.tensors, drawn.non_tensors
        return {"pf_ppo/unique_ratio": len(set(rows.tolist())) / max(len(rows), 1),
                "pf_ppo/score_mean_before": float(scores.float().mean()),
                "pf_ppo/score_mean_after": float(batch["token_level_scores"].sum(-1).float().mean())}

    # -- losses -----------------------------------------------------------------------------
    def policy_loss_fn(self) -> ActorLoss:
        return ActorLoss(self.opts)

    def value_loss_fn(self) -> CriticLoss:
        return CriticLoss(self.cliprange_value)

    # -- metrics and state ------------------------------------------------------------------
    def metrics(self, batch: Batch) -> dict[str, float]:
        from rlx.plugins.algorithms import functional as F

        mask = trained_mask(batch).float()
        valid = mask.bool()
        out: dict[str, float] = dict(self.stats)
        keys = ["advantages", "returns"] + (["values"] if "values" in batch else [])
        for key in keys:
            x = batch[key]
            picked = x[valid]
            out[f"critic/{key}/mean"] = float(F.masked_mean(x, mask))
            out[f"critic/{key}/max"] = float(picked.max()) if picked.numel() else 0.0
            out[f"critic/{key}/min"] = float(picked.min()) if picked.numel() else 0.0
        out["critic/score/mean"] = float(batch["shaped_scores"].mean())
        out["critic/rewards/mean"] = float(batch["token_level_rewards"].sum(-1).mean())
        if "values" in batch:
            out["critic/vf_explained_var"] = F.explained_variance(batch["values"], batch["returns"], mask)
        groups, equal = F.count_equal_score_groups(batch["shaped_scores"], batch["group_index"])
        if groups:
            if equal == groups:
                self.equal_score_steps += 1
                if self.group_relative:
                    warnings.warn(
                        f"every prompt's responses got the same reward in this step, so every "
                        f"{self.opts.adv_estimator} advantage is 0 and the update has only its KL and entropy "
                        "terms (the metric batch/equal_score_steps counts such steps). The task may be too hard or "
                        "too easy for the model, or the reward constant: check a few samples.", stacklevel=2)
            out["batch/equal_score_groups"] = float(equal)
            out["batch/equal_score_group_ratio"] = equal / groups
            out["batch/equal_score_steps"] = float(self.equal_score_steps)
        if "rollout_log_probs" in batch and "old_log_probs" in batch:
            diff_mean, diff_max = F.logprob_diff(batch["rollout_log_probs"], batch["old_log_probs"], mask)
            out["rollout/logprob_diff_mean"] = diff_mean
            out["rollout/logprob_diff_max"] = diff_max
        if self.overlong_buffer_len:
            penalty = batch["shaped_scores"] - batch["scores"].float()
            out["reward/overlong_penalty/mean"] = float(penalty.mean())
            out["reward/overlong_penalty/ratio"] = float((penalty < 0).float().mean())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_ctrl.value, "equal_score_steps": self.equal_score_steps,
                "pf_ppo_draws": self.pf_ppo_draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "kl_coef" in state:
            self.kl_ctrl.value = float(state["kl_coef"])
        self.equal_score_steps = int(state.get("equal_score_steps", 0))
        self.pf_ppo_draws = int(state.get("pf_ppo_draws", 0))


def make_builder(options_cls: type[AlgorithmOptions]
                 ) -> Callable[[AlgorithmOptions | None, BuildContext], PolicyGradient]:
    """``factory(options, ctx)`` for an algorithm module whose defaults are ``options_cls``'s."""

    def build(options: AlgorithmOptions | None, ctx: BuildContext) -> PolicyGradient:
        return PolicyGradient(options or options_cls(), ctx)

    return build
