"""Typed records the controller hands a training backend with a role's :class:`rlx.protocols.RoleSpec`: how
the role's forward passes run (:class:`ForwardOptions`) and its LoRA adapters (:class:`LoraSpec`).

``rlx.step.role_settings`` reads both from a config (:class:`RoleSettings`); the trainer puts them in
each ``RoleSpec`` it builds, and a backend built from a config fills in those a spec leaves at the defaults
(``rlx.plugins.backends.torch_local.with_role_settings``: a spec built without them, as by ``rlx export``,
runs as the config says). Every default is what a backend does when nothing says otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

DEFAULT_CHUNK_SIZE = 1024  # actor.log_prob_chunk_size's default: response positions per chunk of the head


@dataclass(frozen=True)
class ForwardOptions:
    """How one role's forward passes run: packing, micro-batches, the chunked head, compilation and the trained
    weights' dtype. The ``*_option`` fields name the config options that set the token budgets (e.g.
    ``actor.ppo_max_token_len_per_gpu``), for the messages that report a budget too small."""

    use_remove_padding: bool = True  # packed rows (for models that can pack; the others stay padded)
    share_prompts: bool = True  # packed rows with one prompt carry it once (rlx's packed attention)
    use_dynamic_bsz: bool = False  # micro-batches cut by the token budgets below instead of a row count
    ppo_max_token_len: int | None = None  # most tokens in one training micro-batch (use_dynamic_bsz)
    ppo_max_token_len_option: str = "ppo_max_token_len_per_gpu"
    log_prob_max_token_len: int | None = None  # most tokens in one log-prob (value) pass (use_dynamic_bsz)
    log_prob_max_token_len_option: str = "log_prob_max_token_len_per_gpu"
    log_prob_chunk_size: int = DEFAULT_CHUNK_SIZE  # the head's response positions per chunk; 0: all at once
    log_prob_micro_batch_size: int | None = None  # rows per pass without gradients; None: RoleSpec.micro_batch_size
    ulysses_sequence_parallel_size: int = 1  # processes each sequence is split over (fsdp backends)
    use_torch_compile: bool = False  # torch.compile the decoder layers and the chunked head's element-wise work
    model_dtype: Literal["float32", "bfloat16"] = "float32"  # the trained weights' (and optimizer states') dtype

    @property
    def update_budget(self) -> tuple[int, str] | None:
        """(most tokens in one training micro-batch, the option that sets it) under use_dynamic_bsz, else None."""
        return self._budget(self.ppo_max_token_len, self.ppo_max_token_len_option, "ppo_max_token_len")

    @property
    def forward_budget(self) -> tuple[int, str] | None:
        """(most tokens in one pass without gradients, the option that sets it) under use_dynamic_bsz, else None."""
        return self._budget(self.log_prob_max_token_len, self.log_prob_max_token_len_option, "log_prob_max_token_len")

    def _budget(self, tokens: int | None, option: str, field: str) -> tuple[int, str] | None:
        if not self.use_dynamic_bsz:
            return None
        if tokens is None:
            raise ValueError(f"ForwardOptions(use_dynamic_bsz=True) needs {field}, the token budget.")
        return int(tokens), option

    def over(self, base: ForwardOptions) -> ForwardOptions:
        """These options where they differ from the defaults, ``base``'s everywhere else: a spec's own settings
        win over the config's, one field at a time."""
        default = ForwardOptions()
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if getattr(self, f.name) != getattr(default, f.name)}
        return dataclasses.replace(base, **own)


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA adapters a worker puts on its model (``rlx.plugins.modeling.lora.apply``), from ``model.lora_*``."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...] = "all-linear"  # all-linear, or module names / name suffixes
    exclude_modules: tuple[str, ...] = ()  # module names / name suffixes that get no adapter
    dropout: float = 0.0  # on the adapters' input while training
    # A saved peft adapter folder whose weights the adapters start from (model.lora_adapter_path); set by the
    # trainer on the actor of a run that starts (not one that resumes: its checkpoint holds the weights).
    adapter_path: str | None = None

    def __post_init__(self) -> None:  # lists given (as a config holds them) are kept as tuples
        if not isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))

    @property
    def scale(self) -> float:
        """What B @ A is multiplied by: lora_alpha / lora_rank."""
        return float(self.alpha) / int(self.rank)


@dataclass(frozen=True)
class RoleSettings:
    """A role's settings from the config (``rlx.step.role_settings``): its forward options, LoRA and the
    attributes set on its Hugging Face config (``model.override_config``); the dtype of its mixture-of-experts
    routers (``model.router_dtype``)."""

    forward: ForwardOptions = ForwardOptions()
    lora: LoraSpec | None = None
    config_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    router_dtype: str = "auto"


def lora_spec(model: Any) -> LoraSpec | None:
    """The LoRA adapters of ``model`` (the config's ``model`` section: ``lora_rank``, ``lora_alpha``, ...), or None
    when LoRA is off (rank 0)."""
    if model.lora_rank == 0:
        return None
    return LoraSpec(rank=model.lora_rank, alpha=model.lora_alpha, target_modules=model.target_modules,
                    exclude_modules=tuple(model.exclude_modules), dropout=model.lora_dropout)


@dataclass(frozen=True)
class UpdateContext:
    """What the workers of an update need to know of the rollouts besides their tensors, from the controller:
    the ``temperature`` the responses were sampled at (the log-probs are taken at it; 1.0 for greedy), the
    rollouts' ``max_response_length`` (``rollout.max_tokens``; 0: the mini-batch's own width), and whether the
    old log-probs come from the update's own first forward pass (``old_from_update``: the step is on-policy)."""

    temperature: float = 1.0
    max_response_length: int = 0
    old_from_update: bool = False


@dataclass(frozen=True)
class LossContext:
    """What a loss needs besides the micro-batch (the third argument of a ``LossFn``), built once per mini-batch
    by the shared step: the whole mini-batch's response-token and sequence counts summed over every
    data-parallel rank (a micro-batch's loss divides by these, so the micro-batches' gradients add up to the
    mini-batch's exactly), the rollouts' ``max_response_length`` (0: the micro-batch's own width) and
    ``old_from_update`` (:class:`UpdateContext`)."""

    global_tokens: float
    global_seqs: float
    max_response_length: int = 0
    old_from_update: bool = False
