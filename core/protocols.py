"""What each kind of component must provide. Protocols, not base classes: anything with these
methods is a backend, an engine, an algorithm, a reward or a logger.

Tensor shapes use B for sequences in the batch, P for the padded prompt length and R for the padded
response length. Prompts are left-padded, responses right-padded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from rlx.records import ForwardOptions, LoraSpec

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch
    from rlx.records import LossContext, UpdateContext


# ---------------------------------------------------------------------------------------------
# Rollout
@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses. ``n`` samples are drawn for each prompt."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filtering
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    greedy: bool = False
    seed: int | None = None

    @property
    def log_prob_temperature(self) -> float:
        """The temperature of the distribution the responses' log-probs are taken under: the sampling
        temperature, 1.0 for greedy decoding (what the engines report and the trainer scores at)."""
        return 1.0 if self.greedy else self.temperature


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses for a batch of prompts.

    ``generate`` takes a batch with ``input_ids`` (B, P) and ``attention_mask`` (B, P), left-padded,
    and returns a batch of B*n rows (each prompt's samples adjacent) with tensors:
    ``prompts`` (B*n, P), ``prompt_mask`` (B*n, P), ``responses`` (B*n, R), ``response_mask`` (B*n, R)
    and ``rollout_log_probs`` (B*n, R) when the engine computes them. Non-tensor columns of the
    input are repeated for each sample.
    """

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (full, unsharded tensors named as in the HF model).

        The launcher passes a generator that produces the tensors bucket by bucket
        (``rlx.plugins.launchers.weight_sync``),
        on the actor's device or, from another process, as views of a received buffer: load each one as it
        comes (copy it into the engine's own weights) rather than collecting them, so the model is never
        held twice. Called while the engine is awake.
        """

    def sleep(self) -> None:
        """Free device memory (weights and KV cache) while training runs on the same device. Called when
        the engine shares devices with training (``launcher.phase("train")``); on a device with nothing to
        free it should do nothing."""

    def wake_up(self) -> None:
        """Take back the memory freed by :meth:`sleep` (before new weights are loaded and before generating)."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Training backend
LossFn = Callable[[Mapping[str, "torch.Tensor"], "Batch", "LossContext"], tuple["torch.Tensor", dict[str, float]]]
"""``loss_fn(outputs, micro_batch, ctx) -> (loss, metrics)``.

``outputs`` holds ``log_probs`` (b, R), ``entropy`` (b, R) and, for a critic, ``values`` (b, R).
The loss returned is the micro-batch's share of the mini-batch loss (already divided by the
mini-batch's global token or sequence count, ``ctx.global_tokens`` / ``ctx.global_seqs`` of the
:class:`rlx.records.LossContext`), so the backend only sums gradients over micro-batches. A loss with
``needs_entropy_grad = False`` uses the entropy as a metric only, and the backend may then compute it
outside the autograd graph.
"""


@dataclass
class RoleSpec:
    """What a backend builds for one role: ``actor``, ``ref`` or ``critic``. ``forward`` says how its forward
    passes run and ``lora`` which adapters it trains (``rlx.records``; a backend built from a config fills in
    what a spec leaves at the defaults from ``rlx.step.role_settings``)."""

    role: str
    model_path: str
    trainable: bool
    dtype: str = "float32"
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    total_steps: int = 1
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0  # the final lr of a cosine or linear schedule, as a fraction of lr
    grad_clip: float = 1.0
    micro_batch_size: int = 4
    gradient_checkpointing: bool = False
    value_head: bool = False
    seed: int = 0
    trust_remote_code: bool = False
    forward: ForwardOptions = field(default_factory=ForwardOptions)
    lora: LoraSpec | None = None  # None: every weight trains (no adapters)
    # model.override_config: attributes set on the Hugging Face config before the model is built
    config_overrides: dict[str, Any] = field(default_factory=dict)
    # model.router_dtype: auto, or float32 (the mixture-of-experts routers' gate in float32)
    router_dtype: str = "auto"
    # actor.freeze_vision_tower: a vision-language model's vision tower does not train
    freeze_vision_tower: bool = False


@runtime_checkable
class TrainWorker(Protocol):
    """One role's model on one process: computes log-probs and values, and trains. The controller calls
    these through its worker groups, by method reference (``group.call(TrainWorker.compute_log_probs, batch)``),
    so a method renamed here is an error at the call, not a silent miss."""

    def dispatch_info(self) -> DispatchInfo:
        """This worker's data-parallel rank and group size, and whether its results are collected. A worker
        without it is its own data-parallel rank."""

    def compute_log_probs(self, batch: Batch, with_entropy: bool = False, temperature: float = 1.0,
                          with_sum_pi_squared: bool = False) -> Batch:
        """Return a batch with ``log_probs`` (B, R) (and ``entropy`` (B, R) if asked) of the responses under
        the model's logits divided by ``temperature`` (the one they were sampled at). ``with_sum_pi_squared``
        (the optimal-token-baseline estimators): ``sum_pi_squared`` (B, R) too, the sum over the vocabulary of
        the squared probabilities; a backend that cannot compute it raises a UserError."""

    def compute_ref_log_probs(self, batch: Batch, temperature: float = 1.0) -> Batch:
        """With LoRA: the reference's ``log_probs`` (B, R), the actor's base with its adapter switched off (no
        reference worker is built)."""

    def compute_values(self, batch: Batch) -> Batch:
        """Critic only (``RoleSpec.value_head``): a batch with ``values`` (B, R), 0 at padding.

        ``values[:, t]`` is the value of the state *before* response token t (the prompt and
        response tokens 0..t-1): the same position whose logits give the log-prob of token t.
        """

    def update(self, minibatches: list[Batch], loss_fn: LossFn,
               context: UpdateContext | None = None) -> list[dict[str, float]]:
        """One optimizer step per mini-batch (this rank's rows of each), accumulating over micro-batches
        (``rlx.step.run_update``), the forward passes at ``context.temperature``; one metrics dict per step."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full tensors for the rollout engine, named as in the Hugging Face model."""

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def save_pretrained(self, path: str, tokenizer: Any = None) -> None:
        """Write the model (and ``tokenizer``, when given) in Hugging Face format."""


@runtime_checkable
class RewardScorer(Protocol):
    """The reward role's worker (:class:`rlx.run.reward_worker.RewardWorker`): scores a batch of rollouts."""

    def score(self, batch: Batch) -> Batch:
        """``scores`` (B,) and ``token_level_scores`` (B, R), and the reward's own metrics columns."""


# ---------------------------------------------------------------------------------------------
# Algorithm
@dataclass(frozen=True)
class AlgorithmNeeds:
    """What an algorithm asks of the trainer, as data (the trainer reads this, never an algorithm's name).

    ``ref``: a reference model's ``ref_log_probs``; ``critic``: a critic's ``values`` (and its update with
    ``value_loss_fn()``); ``greedy_baseline``: one greedy response per prompt, scored, as ``baseline_scores``
    (B,) and ``baseline_response_length``; ``filter_groups``: dynamic sampling through ``keep_rows(batch)``
    until ``data.train_batch_size`` prompts' groups are kept or ``max_gen_batches`` generation batches were
    drawn (0: one pass over the data); ``old_from_update``: the loss can take the old log-probs from the
    update's own first forward pass (detached), so the trainer may skip that pass when a step is on-policy;
    ``old_from_rollout``: the old log-probs are the rollout engine's ``rollout_log_probs`` (verl's bypass mode: the
    old-log-prob pass never runs, and an engine that returns no log-probs is an error); ``sum_pi_squared``: the
    old-log-prob pass also computes ``sum_pi_squared`` (B, R) (the optimal-token-baseline estimators).
    """

    ref: bool = False
    critic: bool = False
    greedy_baseline: bool = False
    filter_groups: bool = False
    max_gen_batches: int = 0
    old_from_update: bool = False
    old_from_rollout: bool = False
    sum_pi_squared: bool = False


def needs_of(algorithm: Any) -> AlgorithmNeeds:
    """``algorithm.needs``; for an algorithm written against rlx 0.1 (attributes ``needs_ref``,
    ``needs_critic``, ``needs_greedy_baseline``, ``filter_groups``, ``max_num_gen_batches``,
    ``old_log_probs_from_update``), the same read from those."""
    needs = getattr(algorithm, "needs", None)
    if isinstance(needs, AlgorithmNeeds):
        return needs
    return AlgorithmNeeds(ref=bool(getattr(algorithm, "needs_ref", False)),
                          critic=bool(getattr(algorithm, "needs_critic", False)),
                          greedy_baseline=bool(getattr(algorithm, "needs_greedy_baseline", False)),
                          filter_groups=bool(getattr(algorithm, "filter_groups", False)),
                          max_gen_batches=int(getattr(algorithm, "max_num_gen_batches", 0)),
                          old_from_update=bool(getattr(algorithm, "old_log_probs_from_update", False)))


@runtime_checkable
class Algorithm(Protocol):
    """An RL algorithm: advantages from rewards, and the losses that use them.

    ``needs`` says what the trainer must provide (:class:`AlgorithmNeeds`). Besides the members below, an
    algorithm that needs a critic has ``value_loss_fn() -> LossFn``, one that filters groups
    ``keep_rows(batch) -> torch.Tensor`` (a (B,) bool mask of the rows worth training on, whole groups), and
    one with state saved in checkpoints (an adaptive KL coefficient) ``state_dict() -> dict`` /
    ``load_state_dict(dict)`` (JSON-serialisable).
    """

    needs: AlgorithmNeeds

    def compute_advantages(self, batch: Batch) -> Batch:
        """Add ``advantages`` (B, R) and ``returns`` (B, R) to a scored batch.

        The batch holds ``scores`` (B,), ``group_index`` (B,), ``response_mask`` (B, R),
        ``old_log_probs`` (B, R), and ``ref_log_probs`` / ``values`` (B, R) when the algorithm asked
        for a reference model / critic.
        """

    def policy_loss_fn(self) -> LossFn:
        """The actor's loss, used by :meth:`TrainWorker.update`."""

    def metrics(self, batch: Batch) -> dict[str, float]:
        """Per-step statistics of the batch (advantages, returns, KL, ...)."""


@dataclass
class EstimatorInputs:
    """Everything an advantage estimator may use; one object so that new fields never break one.

    An estimator is a function ``fn(inputs: EstimatorInputs) -> (advantages, returns)``, both (B, R)
    and 0 at padding, registered as a ``Component(kind="advantage", name=..., factory=fn)`` through
    the ``rlx_advantage_estimators`` hook and picked with ``algorithm.adv_estimator=NAME``.
    An estimator that needs a critic's values or a greedy baseline says so with a ``requires``
    attribute (see :func:`advantage_estimator`); the algorithm then has the trainer build them.
    """

    response_mask: torch.Tensor  # (B, R) float, 1 on real response tokens
    scores: torch.Tensor  # (B,) sequence rewards: token_level_rewards summed over the response
    token_level_rewards: torch.Tensor  # (B, R) shaped score on the last real token, minus any KL penalty
    group_index: torch.Tensor  # (B,) int; the samples of one prompt share an id
    values: torch.Tensor | None = None  # (B, R) critic values (``requires={"values"}``)
    baseline_scores: torch.Tensor | None = None  # (B,) greedy-response scores (``requires={"baseline_scores"}``)
    gamma: float = 1.0  # discount (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std: bool = True  # grpo: by the group's std (false: Dr. GRPO); remax: by the batch RMS
    options: dict[str, Any] = field(default_factory=dict)  # algorithm.estimator_options, for plugins
    batch: Batch | None = None  # the whole batch, for anything else
    old_log_probs: torch.Tensor | None = None  # (B, R) the old policy's log-probs (``requires={"sum_pi_squared"}``)
    sum_pi_squared: torch.Tensor | None = None  # (B, R) sum over the vocabulary of pi_old^2 (the same requirement)
    rollout_is_weights: torch.Tensor | None = None  # (B, R) algorithm.rollout_correction's IS weights, when set


AdvantageEstimator = Callable[[EstimatorInputs], "tuple[torch.Tensor, torch.Tensor]"]
ESTIMATOR_REQUIREMENTS = ("values", "baseline_scores", "sum_pi_squared")


def advantage_estimator(*, requires: Iterable[str] = ()) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Mark what an estimator needs besides rewards: ``"values"`` (a critic), ``"baseline_scores"`` (a greedy
    response per prompt, as in ReMax) and/or ``"sum_pi_squared"`` (the old-log-prob pass also returns, per token,
    the sum over the vocabulary of the squared probabilities; the old log-probs come with it)::

        @advantage_estimator(requires=["values"])
        def my_gae(inputs: EstimatorInputs): ...
    """
    needs = frozenset(requires)
    unknown = needs - set(ESTIMATOR_REQUIREMENTS)
    if unknown:
        raise ValueError(f"unknown estimator requirements {sorted(unknown)}; known: {ESTIMATOR_REQUIREMENTS}")

    def mark(fn: AdvantageEstimator) -> AdvantageEstimator:
        fn.requires = needs  # type: ignore[attr-defined]
        return fn

    return mark


def estimator_requires(fn: AdvantageEstimator) -> frozenset[str]:
    """What ``fn`` declared with :func:`advantage_estimator` (nothing if it declared nothing)."""
    return frozenset(getattr(fn, "requires", ()))


# ---------------------------------------------------------------------------------------------
# Reward
@dataclass
class RewardBatch:
    """What a reward sees: one entry per response. Plain Python values, no tensors."""

    prompts: list[str]
    responses: list[str]
    ground_truths: list[Any]
    data_sources: list[str]
    extra_infos: list[dict[str, Any]]
    response_lengths: list[int] = field(default_factory=list)
    # Multi-turn episodes (rlx.agent): per response, its turns after the prompt as chat messages
    # ({"role": "assistant" | "tool", "content": ...}, tool turns with "name"); empty for a single-turn response.
    # ``responses`` then hold the whole transcript, tool results included.
    messages: list[list[dict[str, Any]]] = field(default_factory=list)

    def final_answer(self, i: int) -> str:
        """Response ``i``'s answer: the content of its last assistant turn for an episode, else the response."""
        turns = self.messages[i] if i < len(self.messages) else []
        for turn in reversed(turns):
            if turn.get("role") == "assistant":
                return str(turn.get("content", ""))
        return self.responses[i]

    def __len__(self) -> int:
        return len(self.responses)


@dataclass
class RewardOutput:
    """Scores, one per response, optional per-response extra values logged as metrics, and optionally the
    final answer the reward scored in each response (a str, or None where it found none), which majority
    voting in evaluation uses (see rlx.run.evaluation)."""

    scores: list[float]
    extra: dict[str, list[float]] = field(default_factory=dict)
    answers: list[str | None] | None = None


RewardFn = Callable[[RewardBatch], "list[float] | RewardOutput"]


# ---------------------------------------------------------------------------------------------
# Agents: multi-turn episodes with tool calls (rlx.agent runs them)
@dataclass(frozen=True)
class ToolCall:
    """One call a model's turn asked for: a tool's name and its JSON arguments (``id``: the call's id when the
    format has one)."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What a call returned, as the text of the tool's turn. ``error`` is None for a call that worked, else its
    kind: ``"error"`` (the tool raised or rejected its arguments), ``"timeout"``, ``"unknown_tool"`` or
    ``"malformed"`` (the call could not be parsed); the text then says what went wrong, for the model to read."""

    name: str
    content: str
    error: str | None = None
    id: str | None = None


class ToolError(Exception):
    """Raised by a tool for a call it rejects (bad arguments, a program that fails): the message becomes the
    tool's turn, and the call counts as a tool error. Any other exception does too, with its type named."""


@runtime_checkable
class Tool(Protocol):
    """A function an agent's model may call (``agent.tools=[NAME]``, options under ``tools.NAME``).

    ``schema()`` is its OpenAI function schema, ``{"type": "function", "function": {"name", "description",
    "parameters"}}``, given to the chat template (the tools a prompt lists) and checked against calls;
    ``__call__(arguments)`` runs one call and returns its output as text. Calls run in worker threads, several
    at once, each under ``agent.tool_timeout_s``: a tool that blocks on a subprocess should give it its own
    deadline too (the built-in ``python`` tool kills its sandbox). Output past ``agent.max_tool_response_length``
    characters is cut.

    A tool whose calls depend on the episode (the row's ground truth, a session kept across turns) also has
    ``for_episode(row) -> Tool``: the runner calls it once per episode, at its first call of the tool, with the
    prompt's data (``ground_truth``, ``data_source``, ``extra_info``), and sends that episode's calls to the
    tool it returns (the built-in ``calc_gsm8k_reward`` does).
    """

    def schema(self) -> dict[str, Any]: ...

    def __call__(self, arguments: dict[str, Any]) -> str: ...


@runtime_checkable
class AgentLoop(Protocol):
    """Drives one episode (``agent.name``): ``await episode.generate()`` for a model turn, parse it, run tools
    (``await episode.call_tools(calls)``), append their results as a turn (``episode.append_messages``), until
    an answer, ``agent.max_turns`` or the token budget (``data.max_response_length``) ends it.
    :class:`rlx.agent.Episode` documents the methods; the runner batches every episode's turns into engine calls.
    """

    async def run(self, episode: Any) -> None: ...


@dataclass(frozen=True)
class InteractionReply:
    """An interaction's answer to the model's turn: ``content`` is the user turn the model reads next (not trained),
    ``score`` the turn's score (None: no score; recorded, see :class:`Interaction`), ``done`` ends the episode (its
    ``content`` is then not appended: nothing would read it)."""

    content: str
    score: float | None = None
    done: bool = False


@runtime_checkable
class Interaction(Protocol):
    """A simulated user (``agent.interactions=[NAME]``, options under ``interactions.NAME``): after each model turn
    that calls no tool, ``respond(messages, kwargs)`` reads the episode's turns after the prompt (chat messages; the
    last is the model's answer) and the row's ``extra_info.interaction_kwargs`` (``ground_truth`` filled in from the
    row where it has none) and returns an :class:`InteractionReply`. It runs in a worker thread (an ``async def``
    respond is awaited on the runner's loop instead). An interaction that keeps state across an episode's turns also
    has ``for_episode(kwargs) -> Interaction``, called once per episode before its first reply.

    The scores of an episode's replies reach the reward as ``extra_info["turn_scores"]`` (verl's name), in order;
    the reward plugin decides what they count for (the built-in rewards ignore them, as verl's do)."""

    def respond(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> InteractionReply: ...


# ---------------------------------------------------------------------------------------------
# Loggers
@dataclass
class RunInfo:
    """What a logger knows about the run it records."""

    output_dir: str
    project: str
    experiment: str
    config: dict[str, Any]
    resumed: bool = False
    # The step of the checkpoint a resumed run continues from: records logged past it by the interrupted
    # run are replaced by the resumed run's own (loggers that can rewrite their output drop them).
    resumed_step: int = 0


@runtime_checkable
class Logger(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """A few (prompt, response, reward) rows to look at."""

    def finish(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Launchers and worker groups
@dataclass(frozen=True)
class DispatchInfo:
    """What a worker reports after it is built: its data-parallel rank and group size, and whether its
    results are collected (under tensor or sequence parallelism several ranks share one data shard and
    only one of them returns it). Workers without ``dispatch_info()`` are their own data-parallel rank."""

    dp_rank: int
    dp_size: int
    collect: bool = True


WORKER_PROTOCOLS: tuple[str, ...] = ("TrainWorker", "RolloutEngine", "RewardScorer")


def method_name(method: Callable[..., Any] | str) -> str:
    """The name a worker group calls on its workers for ``method``, a method reference:
    ``TrainWorker.update`` -> ``"update"`` (any class's method works: a test's worker, ``object.__getattribute__``).

    Worker groups take method references so that the controller's calls are checked against the protocol
    they name (a renamed or undeclared method fails at the reference). A string, the 0.1 form, still works for
    one release, with a DeprecationWarning.
    """
    if isinstance(method, str):
        import warnings

        warnings.warn(f"worker methods are named by reference now (e.g. TrainWorker.{method}), not by the string "
                      f"{method!r}; strings go in the next release.", DeprecationWarning, stacklevel=3)
        return method
    owner, _, name = getattr(method, "__qualname__", "").rpartition(".")
    if not owner or not name or owner.endswith("<locals>"):
        raise TypeError(f"a worker group calls a method of a class (e.g. TrainWorker.update), not {method!r}")
    return name


@runtime_checkable
class WorkerGroup(Protocol):
    """Workers of one role. The controller calls methods on the group, never on a worker.

    ``call(method, data, *args)`` splits ``data`` by data-parallel rank (a batch into chunks; a list of
    batches, e.g. the mini-batches of an update, chunk by chunk), runs ``method`` on every worker with
    its share, and gathers the collected results (batches concatenated, metric dicts averaged, lists
    entry by entry). ``call_all(method, *args)`` runs ``method`` on every worker with the same arguments.
    ``method`` is a method reference of the protocol the workers implement (``TrainWorker.compute_values``,
    ``RolloutEngine.generate``); a group sends :func:`method_name` of it to its workers.
    """

    world_size: int

    def call(self, method: Callable[..., Any], batch: Batch | list[Batch], *args: Any, **kwargs: Any) -> Any: ...

    def call_all(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class Launcher(Protocol):
    """Places the workers. ``build(rank, world_size)`` is picklable and builds one worker where it runs.

    ``where="workers"``: on the launcher's worker processes (every trained role and the rollout engine);
    ``where="driver"``: in the controller's own process (the reward).
    """

    def create_group(self, role: str, build: Callable[[int, int], Any], where: str = "workers") -> WorkerGroup: ...

    def transfer_weights(self, src: WorkerGroup, dst: WorkerGroup) -> Mapping[str, float]:
        """Load the source role's current weights into the destination (actor -> rollout engine), in buckets;
        returns the transfer's metrics (``weight_sync/bytes``, ``weight_sync/buckets``). Called in the
        "generate" phase."""

    def phase(self, name: Literal["generate", "train"]) -> Mapping[str, float]:
        """Switch to the generate phase (before weights are loaded into the rollout engine and responses
        generated) or the train phase (before the models compute): an engine that shares devices with
        training wakes up or sleeps. Switching to the current phase does nothing. Returns the time taken
        (``timing/wake_up``, ``timing/sleep``), empty when nothing was done."""

    def abort(self) -> None:
        """Stop every worker after an error (they may be blocked in a collective)."""

    def shutdown(self) -> None: ...
