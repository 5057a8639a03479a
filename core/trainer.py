"""The controller: one process holds the batch and drives every role through worker groups.

One step::

    prompts -> rollout.generate (n per prompt) -> reward -> actor old log-probs (skipped when the update is
      on-policy: ``actor.recompute_old_log_prob``) -> ref log-probs
      -> advantages (driver) -> actor update (ppo_epochs x mini-batches x micro-batches)
      -> push actor weights to the rollout engine -> metrics -> loggers; validate / save on schedule

Around generation the launcher switches phases (``launcher.phase``): "generate" before the engine takes new
weights or generates (a colocated engine wakes up), "train" before the models compute (it sleeps).
"""

from __future__ import annotations

import dataclasses
import random
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml

from rlx.agent import AgentLimits, EpisodeRunner, episode_metrics
from rlx.batch import Batch, concat_rollouts
from rlx.context import BuildContext
from rlx.errors import ConfigError, UserError, describe_exception
from rlx.overlap import (
    RolloutAhead,
    Rollouts,
    complete_groups,
    continuation_prompts,
    head_versions,
    restart,
    stitch,
)
from rlx.protocols import RewardScorer, RoleSpec, RolloutEngine, RunInfo, SamplingParams, TrainWorker, needs_of
from rlx.records import UpdateContext
from rlx.registry import PluginManager, call_factory, describe_component
from rlx.run import checkpoint
from rlx.run.data import PromptLoader, collate, load_prompts, resolve_path
from rlx.run.files import check_run_folder_links, is_private, make_tree_private, write_private
from rlx.run.metrics import FlopsCounter, mfu_metrics, peak_tflops
from rlx.run.models import check_config_overrides, check_model_folder, load_tokenizer
from rlx.run.reward_worker import RewardWorker
from rlx.run.vision import copy_processor_files, vision_prompts
from rlx.step import role_settings
from rlx.validate import Resolved

ROLLOUTS_FILE = "rollouts.pt"  # asynchronous RL: rollouts generated before the checkpoint, not yet trained on


def save_rollouts(path: Path, rollouts: Rollouts) -> None:
    """Rollouts not yet trained on, as tensors and plain values (read back without running code)."""
    batch = rollouts.batch
    if not _plain(batch.non_tensors):  # a resume reads them with weights_only: plain containers only
        raise UserError("The rollouts generated ahead of this checkpoint hold data values that a checkpoint cannot "
                        "store as plain data (the data rows' fields must be numbers, strings, lists and dicts).",
                        "Convert those columns of the data file, or train with trainer.max_staleness=0.")
    torch.save({"tensors": batch.tensors, "non_tensors": batch.non_tensors, "metrics": rollouts.metrics,
                "times": rollouts.times, "version": rollouts.version}, path)


def _plain(value: Any) -> bool:
    """Whether ``value`` is made of numbers, strings, bytes, tensors (a prompt's image tensors), None, lists, tuples
    and dicts only."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return False


def load_rollouts(path: Path) -> Rollouts:
    saved = checkpoint.torch_load(path)
    return Rollouts(Batch(saved["tensors"], saved["non_tensors"]), saved["metrics"], saved["times"],
                    int(saved["version"]))


def _groups(batch: Batch | None) -> int:
    return int(batch["group_index"].unique().numel()) if batch is not None and len(batch) else 0


class Timer:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.times[f"timing/{name}"] = self.times.get(f"timing/{name}", 0.0) + time.perf_counter() - start


def ppo_update(group: Any, batch: Batch, loss_fn: Any, *, epochs: int, mini_size: int, shuffle: bool, seed: int,
               prefix: str, metrics: dict[str, list[float]], context: UpdateContext | None = None) -> None:
    """``epochs`` passes over ``batch`` in mini-batches of ``mini_size`` rows, one optimizer step each.

    The driver only cuts the mini-batches (shuffled per epoch with ``seed``); they travel to the role's
    workers in one call, each data-parallel rank receiving its rows of every mini-batch, and the update
    loop runs there (``rlx.step.run_update``). Metrics are collected in ``metrics`` under ``prefix/``
    (keys that already name a section keep theirs), one value per optimizer step.
    """
    gen = torch.Generator().manual_seed(seed)
    minibatches: list[Batch] = []
    for _ in range(epochs):
        data = batch.index(torch.randperm(len(batch), generator=gen)) if shuffle else batch
        minibatches.extend(data.split(mini_size))
    for step in group.call(TrainWorker.update, minibatches, loss_fn, context):
        for k, v in step.items():
            metrics.setdefault(k if "/" in k else f"{prefix}/{k}", []).append(v)


def _call_factory(factory: Any, options: Any, ctx: BuildContext, what: str, rank: int, world_size: int) -> Any:
    """The component's factory, told its rank within the pool that builds it and the pool's size
    (``ctx.rank``, ``ctx.world_size``): a pool of rollout engines seeds each engine from its rank."""
    return call_factory(factory, options, dataclasses.replace(ctx, rank=rank, world_size=world_size), what)


class Trainer:
    def __init__(self, resolved: Resolved, pm: PluginManager) -> None:
        self.resolved, self.cfg, self.pm = resolved, resolved.config, pm
        self.config_dict = resolved.as_dict()  # with every plugin's defaults: config.yaml, loggers, hooks
        cfg = self.cfg
        self.ctx = BuildContext(cfg, RunInfo(str(cfg.run_dir()), cfg.trainer.project, cfg.trainer.experiment,
                                             self.config_dict), pm)
        # First, so that under torchrun the ranks other than 0 go straight to serving rank 0 (they never
        # return from here) and only rank 0 touches the run folder.
        self.launcher = self._build("launcher", cfg.launcher.name, "launcher")
        # model.lora_adapter_path: the adapter's settings fill the model.lora_* options (rlx.run.lora_adapter);
        # the actor of a new run starts from its weights.
        self.start_adapter: str | None = None
        if cfg.model.lora_adapter_path:
            resolved, self.start_adapter = self._adapter_settings(resolved)
            self.resolved, self.cfg = resolved, resolved.config
            self.config_dict = resolved.as_dict()
            cfg = self.cfg
            self.ctx = BuildContext(cfg, RunInfo(str(cfg.run_dir()), cfg.trainer.project, cfg.trainer.experiment,
                                                 self.config_dict), pm)
        self.algorithm = self._build("algorithm", cfg.algorithm.name, "algorithm")  # checks its options vs rollout.n
        self.needs = needs_of(self.algorithm)  # what the algorithm asks of the trainer, as data
        # A bad model folder is reported before anything is written or loaded.
        check_model_folder(resolve_path(cfg.model.path), cfg.model.trust_remote_code,
                           tokenizer=cfg.model.tokenizer_path is None)
        if cfg.critic.model_path:
            check_model_folder(resolve_path(cfg.critic.model_path), cfg.model.trust_remote_code, tokenizer=False,
                               key="critic.model_path")
        if cfg.model.override_config:  # an attribute the model's config lacks is named before any load
            check_config_overrides(cfg)
        self.run_dir = cfg.run_dir()
        self.ckpt_root = self.run_dir / "checkpoints"
        check_run_folder_links(self.run_dir)  # its own files are never links to elsewhere
        self.resume_from = checkpoint.resume_point(self.ckpt_root, self.run_dir, cfg.trainer.resume)
        if self.resume_from is not None:  # another algorithm, reward, model, data... is a new run, not this one
            checkpoint.check_resumable(self.run_dir, self.resume_from, self.config_dict)
        checkpoint.make_dir(self.run_dir, private=cfg.trainer.private_run_dir)
        random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)

        m = cfg.model
        self.model_path = resolve_path(m.path)
        self.tokenizer = load_tokenizer(resolve_path(m.tokenizer_path or m.path), m.trust_remote_code,
                                        key="model.tokenizer_path" if m.tokenizer_path else "model.path")
        d = cfg.data
        # A vision-language model: prompts with images (rlx.run.vision)
        self.vision = vision_prompts(self.model_path, self.tokenizer, m.trust_remote_code)
        # Multi-turn rollouts (rlx.agent): the tools the model may call, listed to it by the chat template.
        self.tools = {name: self._build("tool", name, f"tools.{name}") for name in cfg.agent.tools}
        schemas = [tool.schema() for tool in self.tools.values()] or None
        self.train_set = load_prompts(d.train_files, self.tokenizer, prompt_key=d.prompt_key,
                                      max_prompt_length=d.max_prompt_length,
                                      filter_overlong=d.filter_overlong_prompts, source_key="data.train_files",
                                      tools=schemas, image_key=d.image_key, vision=self.vision,
                                      template_kwargs=d.apply_chat_template_kwargs)
        self.val_set = load_prompts(d.val_files, self.tokenizer, prompt_key=d.prompt_key,
                                    max_prompt_length=d.max_prompt_length,
                                    filter_overlong=d.filter_overlong_prompts,
                                    source_key="data.val_files", tools=schemas, image_key=d.image_key,
                                    vision=self.vision, template_kwargs=d.apply_chat_template_kwargs
                                    ) if d.val_files else None
        self.loader = PromptLoader(self.train_set, d.train_batch_size, shuffle=d.shuffle, seed=cfg.trainer.seed)
        per_epoch = self.loader.batches_per_epoch()
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * per_epoch
        self.sampling = SamplingParams(
            n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k, max_tokens=d.max_response_length, greedy=cfg.rollout.temperature == 0)
        # One greedy response per prompt, for algorithms whose baseline is its score (ReMax).
        self.greedy_sampling = dataclasses.replace(self.sampling, n=1, temperature=0.0, greedy=True)

        resumed_step = checkpoint.read_state(self.resume_from)["step"] if self.resume_from is not None else 0
        run = RunInfo(str(self.run_dir), cfg.trainer.project, cfg.trainer.experiment,
                      self.config_dict, resumed=self.resume_from is not None, resumed_step=resumed_step)
        self.ctx = BuildContext(cfg, run, pm, self.tokenizer)
        # An agent loop other than single_turn runs episodes: their turns are batched into engine calls.
        loop = pm.get("agent_loop", cfg.agent.name)
        self.agent: EpisodeRunner | None = None
        if not loop.extra.get("single_turn"):
            interactions = {name: self._build("interaction", name, f"interactions.{name}")
                            for name in cfg.agent.interactions}
            self.agent = EpisodeRunner(self._build("agent_loop", cfg.agent.name, "agent"), self.tools, self.tokenizer,
                                       AgentLimits.from_config(cfg.agent), self._engine_generate,
                                       describe_component(loop), interactions,
                                       template_kwargs=cfg.data.apply_chat_template_kwargs)
        if self.agent is not None and self.vision is not None and any(
                e.images is not None for e in self.train_set.examples):
            raise ConfigError([f"agent.name={cfg.agent.name} runs multi-turn episodes, which are text only, and "
                               f"the training prompts hold images ({d.image_key}): use agent.name=single_turn for "
                               "a vision-language model's prompts with images."])
        if self.needs.old_from_rollout and cfg.actor.recompute_old_log_prob is True:
            raise ConfigError(["actor.recompute_old_log_prob=true asks for the old-log-prob pass, but "
                               "algorithm.rollout_correction.bypass_mode takes the old log-probs from the rollout "
                               "engine instead: leave actor.recompute_old_log_prob at auto, or set bypass_mode=false."])
        if cfg.actor.recompute_old_log_prob is False and not self.needs.old_from_rollout:
            problem = self._on_policy_problem(d.train_batch_size * cfg.rollout.n,
                                              cfg.actor.ppo_mini_batch_size * cfg.rollout.n)
            if problem is not None:
                raise ConfigError([f"actor.recompute_old_log_prob=false skips the old-log-prob pass, which is "
                                   f"exact only when the update is on-policy, but {problem}. Leave it at auto "
                                   "(skipped exactly when on-policy) or set it to true."])
        self._build_roles()
        self.flops = self._flops_counter()
        self.loggers = {name: self._build("logger", name, f"loggers.{name}") for name in cfg.trainer.loggers}
        self.step = 0
        self.steps_done = 0  # the last step trained and logged (self.step is the one under way)
        self.saved_step: int | None = None  # the step of the newest complete checkpoint of this run
        # Asynchronous RL (trainer.max_staleness >= 1, rlx.overlap): the policy version is the number of actor
        # updates so far; the engine's is the version of the weights it holds.
        self.max_staleness = cfg.trainer.max_staleness
        self.version = self.engine_version = 0
        self.ahead: RolloutAhead | None = None
        self.resumed_rollouts: Rollouts | None = None  # rollouts a checkpoint of an asynchronous run holds
        self.carry: Batch | None = None  # partial rollouts: responses of unfinished groups, to be continued
        self.finished_pool: Batch | None = None  # partial rollouts: finished groups beyond a step's batch
        self._interrupt = threading.Event()
        self._groups_seen = 0  # partial rollouts: a group's number is unique over the run
        if self.max_staleness:
            self.ahead = RolloutAhead(concurrent=bool(getattr(self.rollout, "overlaps_training", False)))
            self._check_async()

    # -- set-up -------------------------------------------------------------------------------
    def _adapter_settings(self, resolved: Resolved) -> tuple[Resolved, str | None]:
        """The config with ``model.lora_adapter_path``'s LoRA settings and the folder the actor starts from;
        a resumed run's settings come from its record and its weights from its checkpoint (no folder)."""
        from rlx.run.lora_adapter import with_adapter_settings

        cfg = resolved.config
        run_dir = cfg.run_dir()
        recorded = None
        if checkpoint.resume_point(run_dir / "checkpoints", run_dir, cfg.trainer.resume) is not None:
            try:
                old = yaml.safe_load((run_dir / "config.yaml").read_text())
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                old = None  # said by check_resumable
            recorded = old.get("model") if isinstance(old, dict) and isinstance(old.get("model"), dict) else {}
        return with_adapter_settings(resolved, recorded)

    def _build(self, kind: str, name: str, options_key: str) -> Any:
        return self.pm.build(kind, name, self.resolved.options.get(options_key), self.ctx)

    def _role_spec(self, role: str, trainable: bool) -> RoleSpec:
        cfg, o = self.cfg, self.cfg.actor.optim
        minibatches = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
        total = self.total_steps * cfg.actor.ppo_epochs * minibatches
        settings = role_settings(cfg, role)
        return RoleSpec(
            role=role, model_path=self.model_path, trainable=trainable, dtype=cfg.model.dtype, lr=o.lr,
            weight_decay=o.weight_decay, betas=o.betas, warmup_steps=o.warmup_for(total),
            total_steps=total, lr_schedule=o.lr_schedule, min_lr_ratio=o.min_lr_ratio,
            grad_clip=o.grad_clip, micro_batch_size=cfg.actor.micro_batch_size_per_device,
            gradient_checkpointing=cfg.model.gradient_checkpointing, seed=cfg.trainer.seed,
            trust_remote_code=cfg.model.trust_remote_code,
            forward=dataclasses.replace(
                settings.forward, log_prob_micro_batch_size=cfg.actor.log_prob_micro_batch_size_per_device),
            lora=settings.lora if settings.lora is None or role != "actor" or not self.start_adapter
            else dataclasses.replace(settings.lora, adapter_path=self.start_adapter),
            config_overrides=dict(settings.config_overrides), router_dtype=settings.router_dtype,
            freeze_vision_tower=trainable and role == "actor" and cfg.actor.freeze_vision_tower,
        )

    def _critic_spec(self) -> RoleSpec:
        cfg, c = self.cfg, self.cfg.critic
        minibatches = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
        epochs = c.ppo_epochs or cfg.actor.ppo_epochs
        spec = self._role_spec("critic", True)
        return dataclasses.replace(
            spec, model_path=resolve_path(c.model_path) if c.model_path else self.model_path,
            value_head=True, lr=c.optim.lr, weight_decay=c.optim.weight_decay, betas=c.optim.betas,
            warmup_steps=c.optim.warmup_for(self.total_steps * epochs * minibatches),
            total_steps=self.total_steps * epochs * minibatches,
            lr_schedule=c.optim.lr_schedule, min_lr_ratio=c.optim.min_lr_ratio, grad_clip=c.optim.grad_clip,
            micro_batch_size=c.micro_batch_size_per_device,
            forward=dataclasses.replace(spec.forward, log_prob_micro_batch_size=c.forward_micro_batch_size_per_device))

    def _builder(self, kind: str, name: str, options_key: str) -> Any:
        """A picklable ``build(rank, world_size)`` that calls the component's factory where the worker
        runs (another process, under a multi-process launcher): the factory, its options and a build
        context carrying the config, the run and the tokenizer, but not the plugin manager."""
        comp = self.pm.get(kind, name)
        what = describe_component(comp)
        ctx = dataclasses.replace(self.ctx, plugins=None)
        return partial(_call_factory, comp.load_factory(), self.resolved.options.get(options_key), ctx, what)

    def _build_roles(self) -> None:
        cfg = self.cfg
        backend = self._build("backend", cfg.backend.name, "backend")  # a picklable builder of workers
        self.actor = self.launcher.create_group("actor", partial(backend.worker, self._role_spec("actor", True)))
        # With LoRA the reference is the actor's base with the adapter switched off: no second model.
        self.ref_from_actor = self.needs.ref and cfg.model.lora_rank > 0
        self.ref = (self.launcher.create_group("ref", partial(backend.worker, self._role_spec("ref", False)))
                    if self.needs.ref and not self.ref_from_actor else None)
        # The critic (value model) only when the algorithm's advantages need values.
        self.critic = (self.launcher.create_group("critic", partial(backend.worker, self._critic_spec()))
                       if self.needs.critic else None)
        self.rollout = self.launcher.create_group("rollout", self._builder("rollout", cfg.rollout.name, "rollout"))
        # The reward runs here, on the driver: it needs the decoded responses, the data rows and the tokenizer.
        reward_fn = self._build("reward", cfg.reward.name, "reward")
        self.reward = self.launcher.create_group(
            "reward", lambda rank, world: RewardWorker(reward_fn, self.tokenizer, cfg.reward.name, cfg.reward),
            where="driver")

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        cfg = self.cfg
        metrics: dict[str, float] = {}
        try:
            if self.resume_from is not None:
                self._load(self.resume_from)
            self.launcher.phase("generate")
            if self.resume_from is not None and self.step >= self.total_steps:
                return metrics  # nothing to do, said by _load; the run's record and model are left as they are
            self.launcher.transfer_weights(self.actor, self.rollout)
            self.engine_version = self.version
            if self.resume_from is None or not (self.run_dir / "config.yaml").is_file():
                # A run's record is written once, by the run that made it; a resume leaves it as it is.
                write_private(self.run_dir / "config.yaml", yaml.safe_dump(self.config_dict, sort_keys=False))
            # The provenance plugin writes provenance.json here (versions, plugins, data and model hashes).
            self.pm.call_lifecycle("rlx_on_train_start", config=self.config_dict, output_dir=str(self.run_dir),
                                   plugins=self.pm, resumed=self.resume_from is not None)
            # trainer.test_freq -1 or 0 turns validation off, the one before training included.
            if self.val_set is not None and cfg.trainer.val_before_train and cfg.trainer.test_freq > 0 \
                    and self.step == 0:
                self._log({**self.validate(), "progress/total_steps": float(self.total_steps)}, self.step)
            self.steps_done = self.step
            while self.step < self.total_steps:
                self.step += 1
                if self.ahead is not None:
                    metrics = self.async_step()
                elif self.resumed_rollouts is not None:  # saved by an asynchronous run: trained on first
                    rollouts, self.resumed_rollouts = self.resumed_rollouts, None
                    metrics = self._train_on(rollouts.batch, rollouts.metrics, Timer(), time.perf_counter())
                else:
                    metrics = self.train_step(self._next_examples())
                t = cfg.trainer
                if self.val_set is not None and t.test_freq > 0 and (
                        self.step % t.test_freq == 0 or self.step == self.total_steps):
                    metrics.update(self.validate())
                self._log(metrics, self.step)
                self.steps_done = self.step  # logged: what an interrupted run reports as its last step
                self.pm.call_lifecycle("rlx_on_step_end", step=self.step, metrics=metrics)
                if t.save_freq > 0 and self.step % t.save_freq == 0 and self.step < self.total_steps:
                    self.save()
            if cfg.trainer.save_freq != 0 and self.saved_step != self.step:
                self.save()
            if cfg.trainer.save_hf_model:
                self.save_hf(self.run_dir / "hf_model")
            self.pm.call_lifecycle("rlx_on_train_end", step=self.step, metrics=metrics)
        except BaseException:
            self.launcher.abort()  # workers in other processes may be blocked in a collective
            raise
        finally:
            for name in list(self.loggers):
                self._call_logger(name, "finish")
            self.launcher.shutdown()
        return metrics

    def _next_examples(self) -> list[Any]:
        """The next batch of prompts; a new epoch starts when the current one is used up. The loader's
        position is saved in checkpoints, so a resumed run draws the same batches."""
        for examples in self.loader:
            return examples
        self.loader.next_epoch()
        for examples in self.loader:
            return examples
        raise RuntimeError("the prompt loader yields no batch")

    def train_step(self, examples: list[Any]) -> dict[str, float]:
        """One synchronous step (``trainer.max_staleness=0``): generate, then train, then the engine takes
        the new weights."""
        timer = Timer()
        step_start = time.perf_counter()
        batch, rollout_metrics = self._rollout(examples, timer)
        if len(batch):
            batch.tensors["policy_version"] = torch.full((len(batch),), self.version, dtype=torch.long)
        return self._train_on(batch, rollout_metrics, timer, step_start)

    def async_step(self) -> dict[str, float]:
        """One step of asynchronous RL (``trainer.max_staleness=K >= 1``, ``rlx.overlap``).

        The rollouts this step trains on were generated while the previous step trained (the first step's are
        generated now). Once they are here the engine is idle: it takes the newest weights if the next step's
        rollouts would otherwise lag more than K versions behind the policy that trains on them, and starts
        generating them; then this step trains, beside that generation.
        """
        assert self.ahead is not None
        timer = Timer()
        step_start = time.perf_counter()
        if self.cfg.rollout.partial:
            rollouts, waited = self._take_partial()
        else:
            if not self.ahead.in_flight and self.ahead.ready is None:
                self._launch_rollout()  # the first step, and the first after a resume without pending rollouts
            taken, waited = self.ahead.take()
            assert taken is not None
            rollouts = taken
        timer.times["timing/wait_rollout"] = waited
        for key, seconds in rollouts.times.items():
            timer.times[key] = timer.times.get(key, 0.0) + seconds
        idle, sync_metrics = 0.0, {}
        if self.step < self.total_steps:
            next_version = self.version + int(self.critic is None or self.step > self.cfg.critic.warmup_steps)
            if next_version - self.engine_version > self.max_staleness:
                with timer("weight_sync"):
                    sync_metrics = self._push_weights()
            if self.cfg.rollout.partial:
                # A response whose first token would be more than K versions old when trained is made again.
                stale = (next_version - head_versions(self.carry) > self.max_staleness) if _groups(self.carry) \
                    else torch.zeros(0, dtype=torch.bool)
                rollouts.metrics["rollout/partial/restarted"] = float(stale.sum())
                if bool(stale.any()):
                    self.carry = restart(self.carry, stale, self.tokenizer.pad_token_id)
            idle = self._launch_rollout()
        train_start = time.perf_counter()
        metrics = self._train_on(rollouts.batch, rollouts.metrics, timer, step_start)
        train_end = time.perf_counter()
        metrics.update(sync_metrics)
        seconds = max(metrics.get("timing/step", train_end - step_start), 1e-9)
        overlap = self.ahead.overlap(train_start, train_end) if self.step < self.total_steps else 0.0
        metrics.update({"timing/overlap": overlap, "timing/rollout_idle": idle,
                        "async/trainer_wait_share": waited / seconds, "async/rollout_wait_share": idle / seconds,
                        "async/engine_version": float(self.engine_version)})
        return metrics

    def _launch_rollout(self, fresh: bool = True) -> float:
        """Start generating the next step's rollouts with the weights the engine holds now (partial rollouts: the
        unfinished responses carried over, then, with ``fresh``, a new batch of prompts)."""
        assert self.ahead is not None
        version = self.engine_version
        if not self.cfg.rollout.partial:
            return self.ahead.launch(partial(self._produce, version))
        carry, self.carry = self.carry, None
        self._interrupt = threading.Event()
        return self.ahead.launch(partial(self._produce_partial, version, carry, self._interrupt, fresh))

    def _take_partial(self) -> tuple[Rollouts, float]:
        """Partial rollouts: the generation under way stops where it is (the step boundary); the groups whose
        responses are all finished are this step's, up to data.train_batch_size of them, the others are carried
        into the next rollout. When fewer have finished, the engine takes the newest weights and the carried
        responses continue to their end first."""
        assert self.ahead is not None
        if self.ahead.in_flight:
            self._interrupt.set()
        elif self.ahead.ready is None:
            self._launch_rollout()
        taken, waited = self.ahead.take()
        assert taken is not None
        pad, target = self.tokenizer.pad_token_id, self.cfg.data.train_batch_size
        pool = concat_rollouts([b for b in (self.finished_pool, taken.batch) if b is not None and len(b)], pad)
        self.carry = taken.carry
        while _groups(pool) < target and self.carry is not None and len(self.carry):
            # Fewer finished groups than a batch: the newest weights go to the engine and the carried responses
            # continue until they end (the step waits for them; no new prompts meanwhile).
            timer = Timer()
            if self.engine_version != self.version:
                with timer("weight_sync"):
                    self._push_weights()
            self._launch_rollout(fresh=False)
            more, seconds = self.ahead.take()
            assert more is not None
            waited += seconds
            for key, value in [*timer.times.items(), *more.times.items()]:
                taken.times[key] = taken.times.get(key, 0.0) + value
            taken.metrics["rollout/partial/continued"] += more.metrics["rollout/partial/continued"]
            pool = concat_rollouts([b for b in (pool, more.batch) if len(b)], pad)
            self.carry = more.carry
        taken.metrics["rollout/partial/carried"] = float(len(self.carry)) if self.carry is not None else 0.0
        # A step trains on data.train_batch_size groups (fewer only when nothing is left to continue); the
        # finished groups beyond those wait for the next step.
        first = list(dict.fromkeys(pool["group_index"].tolist()))[:target] if len(pool) else []
        keep = torch.isin(pool["group_index"], torch.tensor(first, dtype=torch.long)) if len(pool) else None
        if keep is not None and not bool(keep.all()):
            self.finished_pool = pool.index((~keep).nonzero().squeeze(-1))
            pool = pool.index(keep.nonzero().squeeze(-1))
        else:
            self.finished_pool = None
        taken.metrics["rollout/partial/waiting_groups"] = float(_groups(self.finished_pool))
        return Rollouts(pool, taken.metrics, taken.times, taken.version, taken.started, taken.finished), waited

    def _produce_partial(self, version: int, carry: Batch | None, interrupt: threading.Event,
                         fresh: bool) -> Rollouts:
        """The job of partial rollouts: the carried responses continue, a new batch of prompts starts (unless
        the carried groups make a batch already), all until done or ``interrupt``; the finished groups are
        scored."""
        timer = Timer()
        start = time.perf_counter()
        pad, max_tokens, n = self.tokenizer.pad_token_id, self.sampling.max_tokens, self.sampling.n
        parts: list[Batch] = []
        continued = 0
        with timer("gen"):
            if carry is not None and len(carry):
                todo = (~carry["finished"]).nonzero().squeeze(-1)
                merged = carry
                if len(todo):
                    rows = carry.index(todo)
                    budget = int(max_tokens - rows["response_mask"].sum(-1).min())
                    params = dataclasses.replace(self.sampling, n=1, max_tokens=budget)
                    new = self.rollout.call(RolloutEngine.generate, continuation_prompts(rows, pad), params,
                                            interrupt=interrupt)
                    rows = stitch(rows, new, version, max_tokens, pad)
                    done = carry.index(carry["finished"].nonzero().squeeze(-1))
                    merged = concat_rollouts([done, rows], pad) if len(done) else rows
                    continued = len(todo)
                parts.append(merged)
            if fresh and _groups(carry) < self.cfg.data.train_batch_size:
                prompts = collate(self._next_examples(), pad, self.vision)
                batch = self.rollout.call(RolloutEngine.generate, prompts, self.sampling, interrupt=interrupt)
                batch.tensors["group_index"] = torch.arange(len(prompts)).repeat_interleave(n) + self._groups_seen
                batch.tensors["response_versions"] = batch["response_mask"] * version
                self._groups_seen += len(prompts)
                parts.append(batch)
        batch = concat_rollouts(parts, pad)
        complete = complete_groups(batch)
        ready = batch.index(complete.nonzero().squeeze(-1))
        rest = batch.index((~complete).nonzero().squeeze(-1))
        if len(ready):
            with timer("reward"):
                ready.update(self.reward.call(RewardScorer.score, ready))
            ready.tensors["policy_version"] = head_versions(ready)
        metrics = {"rollout/partial/continued": float(continued), "rollout/partial/carried": float(len(rest)),
                   "rollout/partial/interrupted": float(interrupt.is_set())}
        return Rollouts(ready, metrics, timer.times, version, start, time.perf_counter(), carry=rest)

    def _produce(self, version: int) -> Rollouts:
        """The job of :class:`rlx.overlap.RolloutAhead`: the next prompts, generated and scored."""
        timer = Timer()
        start = time.perf_counter()
        batch, metrics = self._rollout(self._next_examples(), timer)
        if len(batch):
            batch.tensors["policy_version"] = torch.full((len(batch),), version, dtype=torch.long)
        return Rollouts(batch, metrics, timer.times, version, start, time.perf_counter())

    def _push_weights(self) -> dict[str, float]:
        """The actor's weights to the idle engine (asynchronous RL)."""
        metrics = dict(self.launcher.transfer_weights(self.actor, self.rollout))
        self.engine_version = self.version
        return metrics

    def _settle_rollouts(self, push: bool) -> None:
        """Before validating or saving in asynchronous RL: the generation under way ends (its rollouts wait to
        be trained on) and, with ``push``, the engine takes the newest weights (validation scores the policy
        of this step, as in the synchronous loop)."""
        if self.ahead is None:
            return
        self.ahead.wait()
        if push and self.engine_version != self.version:
            self._push_weights()

    def _check_async(self) -> None:
        """What asynchronous RL does not combine with, said before anything runs."""
        problems = []
        if self.needs.filter_groups and self.cfg.rollout.partial:
            problems.append("rollout.partial: dynamic sampling (algorithm.filter_groups) draws more prompts until "
                            "enough groups differ, which an interrupted rollout cannot; set one of them off.")
        if self.needs.greedy_baseline and self.cfg.rollout.partial:
            problems.append(f"rollout.partial: algorithm {self.cfg.algorithm.name!r} scores a greedy response per "
                            "prompt as its baseline, which an interrupted rollout does not make; set "
                            "rollout.partial=false.")
        if problems:
            raise ConfigError(problems)
        options = self.config_dict.get("algorithm", {})
        correction = options.get("rollout_correction") or {}
        if "tis_cap" in options and options.get("tis_cap") is None and not (
                correction.get("rollout_is") or correction.get("rollout_rs")):
            print(f"Note: trainer.max_staleness={self.max_staleness}: rollouts come from a policy up to "
                  f"{self.max_staleness} version(s) older than the one that trains; algorithm.tis_cap=2 (or "
                  "algorithm.rollout_correction) corrects for that (docs/rollout.md).", file=sys.stderr)
        if not self.ahead or self.ahead.concurrent:
            return
        print(f"Note: trainer.max_staleness={self.max_staleness}: the rollout engine shares processes with the "
              "trained models (launcher.rollout_nproc=0 with several processes), so the next step's rollouts are "
              "generated before this step trains, not beside it: the same staleness, no overlap. Give the engine "
              "processes of its own (launcher.rollout_nproc=K) for the overlap.", file=sys.stderr)

    def _train_on(self, batch: Batch, rollout_metrics: dict[str, float], timer: Timer,
                  step_start: float) -> dict[str, float]:
        cfg = self.cfg
        if not len(batch):  # dynamic sampling found nothing to train on within its limit
            return {**rollout_metrics, **timer.times, "timing/step": time.perf_counter() - step_start}
        staleness = (self.version - batch["policy_version"]).float()
        if self.ahead is None:
            self._phase("train", timer)  # asynchronous RL: the engine generates beside training, awake
        mini_size = cfg.actor.ppo_mini_batch_size * self.sampling.n
        # The log-probs are taken at the temperature the responses were sampled at.
        temperature = self.sampling.log_prob_temperature
        # The update's forward runs the policy that would score them: its log-probs, detached, are the old
        # ones (ActorLoss), so the old-log-prob pass is skipped.
        from_update = self._old_log_probs_from_update(len(batch), mini_size)
        context = UpdateContext(temperature, self.sampling.max_tokens, from_update)
        if self.needs.old_from_rollout:  # bypass mode: pi_old is the rollout engine's policy
            if "rollout_log_probs" not in batch.tensors:
                raise UserError(f"algorithm {cfg.algorithm.name!r} takes the old log-probs from the rollout engine "
                                "(algorithm.rollout_correction.bypass_mode), but this engine returns none (no "
                                "rollout_log_probs in its batch).",
                                "Use an engine that returns them (hf, vllm, sglang) or set "
                                "algorithm.rollout_correction.bypass_mode=false.")
            batch.tensors["old_log_probs"] = batch["rollout_log_probs"].float()
        elif not from_update:
            with timer("old_log_prob"):
                if self.needs.sum_pi_squared:
                    scored = self.actor.call(TrainWorker.compute_log_probs, batch, temperature=temperature,
                                             with_sum_pi_squared=True)
                    batch.tensors["sum_pi_squared"] = scored["sum_pi_squared"]
                else:
                    scored = self.actor.call(TrainWorker.compute_log_probs, batch, temperature=temperature)
                batch.tensors["old_log_probs"] = scored["log_probs"]
        if self.ref is not None:
            with timer("ref"):
                batch.tensors["ref_log_probs"] = self.ref.call(TrainWorker.compute_log_probs, batch,
                                                               temperature=temperature)["log_probs"]
        elif self.ref_from_actor:
            with timer("ref"):
                batch.tensors["ref_log_probs"] = self.actor.call(TrainWorker.compute_ref_log_probs, batch,
                                                                 temperature=temperature)["log_probs"]
        if self.critic is not None:
            with timer("values"):
                batch.tensors["values"] = self.critic.call(TrainWorker.compute_values, batch)["values"]
        with timer("adv"):
            self.algorithm.compute_advantages(batch)
        update: dict[str, list[float]] = {}
        if self.critic is not None:
            with timer("update_critic"):
                ppo_update(self.critic, batch, self.algorithm.value_loss_fn(), epochs=cfg.critic.ppo_epochs or
                           cfg.actor.ppo_epochs, mini_size=mini_size, shuffle=cfg.actor.shuffle,
                           seed=cfg.trainer.seed + self.step, prefix="critic", metrics=update, context=context)
        sync_metrics = {}
        if self.critic is None or self.step > cfg.critic.warmup_steps:  # critic warm-up: the actor waits
            with timer("update_actor"):
                ppo_update(self.actor, batch, self.algorithm.policy_loss_fn(), epochs=cfg.actor.ppo_epochs,
                           mini_size=mini_size, shuffle=cfg.actor.shuffle, seed=cfg.trainer.seed + self.step,
                           prefix="actor", metrics=update, context=context)
            self.version += 1
            if self.ahead is None:  # asynchronous RL: the engine takes them when it is idle (async_step)
                self._phase("generate", timer)
                with timer("weight_sync"):
                    sync_metrics = dict(self.launcher.transfer_weights(self.actor, self.rollout))
                self.engine_version = self.version
        metrics = self._step_metrics(batch, timer, time.perf_counter() - step_start)
        metrics.update(sync_metrics)
        metrics.update(rollout_metrics)
        metrics.update({k: sum(v) / len(v) for k, v in update.items()})
        metrics.update(self.algorithm.metrics(batch))
        if self.ahead is not None:
            metrics.update({"async/staleness/mean": float(staleness.mean()),
                            "async/staleness/max": float(staleness.max()), "async/policy_version": float(self.version)})
        self._log_samples(batch)
        return metrics

    def _on_policy_problem(self, rows: int, mini_size: int) -> str | None:
        """Why the actor update of a step of ``rows`` rollouts may not take its old log-probs from its own
        forward pass, or None when it may: one epoch of one mini-batch (the only optimizer step of the update
        comes after the forward, so that forward runs the policy that generated), and an algorithm that reads
        the old log-probs in its loss only."""
        a = self.cfg.actor
        if a.ppo_epochs != 1:
            return f"actor.ppo_epochs={a.ppo_epochs}: every epoch after the first runs an updated policy"
        if rows > mini_size:
            return (f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} cuts a step's rollouts into several "
                    "optimizer steps, and each after the first runs an updated policy")
        if not self.needs.old_from_update:
            return (f"algorithm {self.cfg.algorithm.name!r} needs the old log-probs before the update (e.g. "
                    "use_kl_in_reward) or does not say that its loss can take them from the update's forward")
        return None

    def _old_log_probs_from_update(self, rows: int, mini_size: int) -> bool:
        """Whether this step skips the old-log-prob pass (``actor.recompute_old_log_prob``)."""
        setting = self.cfg.actor.recompute_old_log_prob
        if setting is True:
            return False
        # false was checked at start-up, and a step never has more rows than there (dynamic sampling keeps at
        # most data.train_batch_size groups).
        return setting is False or self._on_policy_problem(rows, mini_size) is None

    def _phase(self, name: str, timer: Timer) -> None:
        """Switch the launcher's phase; the sleep / wake-up it took is timed in this step."""
        for key, seconds in self.launcher.phase(name).items():
            timer.times[key] = timer.times.get(key, 0.0) + seconds

    def _wake_rollout(self) -> dict[str, float]:
        """Switch to the generate phase before generating. An engine woken up here slept through a step
        without an actor update (critic warm-up): it takes the actor's weights again, as after every update,
        since sleeping may have discarded them (``hf``'s ``free_on_sleep=discard``)."""
        times = dict(self.launcher.phase("generate"))
        if "timing/wake_up" in times:
            start = time.perf_counter()
            self.launcher.transfer_weights(self.actor, self.rollout)
            times["timing/weight_sync"] = time.perf_counter() - start
        return times

    def _engine_generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.rollout.call(RolloutEngine.generate, prompts, params)

    def _generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """The rollouts of ``prompts``: the engine's responses, or with an agent loop its episodes (rlx.agent)."""
        return self.agent.run(prompts, params) if self.agent is not None else self._engine_generate(prompts, params)

    def _generate_scored(self, examples: list[Any], timer: Timer, first_group: int = 0) -> Batch:
        """n responses per prompt, scored; ``group_index`` numbers the prompts from ``first_group``."""
        for key, seconds in self._wake_rollout().items():
            timer.times[key] = timer.times.get(key, 0.0) + seconds
        prompts = collate(examples, self.tokenizer.pad_token_id, self.vision)
        n = self.sampling.n
        with timer("gen"):
            batch: Batch = self._generate(prompts, self.sampling)
        batch.tensors["group_index"] = torch.arange(len(prompts)).repeat_interleave(n) + first_group
        with timer("reward"):
            batch.update(self.reward.call(RewardScorer.score, batch))
        if self.needs.greedy_baseline:
            with timer("gen_baseline"):
                greedy: Batch = self._generate(prompts, self.greedy_sampling)
                scored = self.reward.call(RewardScorer.score, greedy)
            batch.tensors["baseline_scores"] = scored["scores"].repeat_interleave(n)
            batch.tensors["baseline_response_length"] = greedy["response_mask"].sum(-1).repeat_interleave(n)
        return batch

    def _rollout(self, examples: list[Any], timer: Timer) -> tuple[Batch, dict[str, float]]:
        """The step's scored rollouts.

        With dynamic sampling (the algorithm's ``filter_groups``), only the groups the algorithm keeps
        (``keep_rows``: not all rewards equal) are trained on, and more prompt batches are drawn from
        the loader until ``data.train_batch_size`` prompts' groups are kept (extra ones are dropped) or
        ``max_num_gen_batches`` batches were generated; then the step trains on what it has.
        """
        alg = self.algorithm
        if not self.needs.filter_groups:
            return self._generate_scored(examples, timer), {}
        target, limit = self.cfg.data.train_batch_size, self.needs.max_gen_batches
        # "No limit" still ends: after a whole pass over the training prompts the step trains on what it
        # kept, or, if every group of that pass scored the same, the run stops with a message.
        pass_size = self.loader.batches_per_epoch()
        kept: list[Batch] = []
        all_scores: list[torch.Tensor] = []
        kept_groups = seen_groups = gen_batches = 0
        while True:
            batch = self._generate_scored(examples, timer, first_group=seen_groups)
            gen_batches += 1
            seen_groups += len(examples)
            all_scores.append(batch["scores"])
            keep = alg.keep_rows(batch)
            if bool(keep.any()):
                part = batch.index(keep.nonzero().squeeze(-1))
                kept.append(part)
                kept_groups += int(part["group_index"].unique().numel())
            if kept_groups >= target or (limit and gen_batches >= limit):
                break
            if not limit and gen_batches >= pass_size:
                if not kept_groups:
                    raise UserError(
                        f"Dynamic sampling found no prompt whose {self.sampling.n} responses got different "
                        f"rewards in a whole pass over the training data ({gen_batches} generation batches): "
                        "there is no signal to train on.",
                        "The task is too easy or too hard for the model (or the reward is constant): check the "
                        "reward on a few samples, or turn dynamic sampling off (algorithm.filter_groups=false).")
                break
            examples = self._next_examples()
        scores = torch.cat(all_scores)
        metrics = {"rollout/num_gen_batches": float(gen_batches),
                   "rollout/filtered_group_ratio": 1.0 - kept_groups / seen_groups,
                   "rollout/kept_groups": float(min(kept_groups, target)),
                   "rollout/all_reward/mean": float(scores.mean())}
        if kept_groups < target:
            warnings.warn(f"step {self.step}: dynamic sampling kept {kept_groups} of {target} prompts' groups in "
                          f"{gen_batches} generation batches (algorithm.max_num_gen_batches={limit}); "
                          + ("training on those." if kept_groups else "skipping this step's update.")
                          + " Most prompts get the same reward on every sample: the data may be too easy or "
                          "too hard for the model.", RuntimeWarning, stacklevel=2)
        if not kept:
            return Batch(), metrics
        batch = concat_rollouts(kept, self.tokenizer.pad_token_id)
        if kept_groups > target:  # keep the first `target` groups, whole
            first = batch["group_index"].unique()[:target]
            batch = batch.index(torch.isin(batch["group_index"], first).nonzero().squeeze(-1))
        return batch, metrics

    def _flops_counter(self) -> tuple[FlopsCounter, float | None] | None:
        """The actor's FLOPs counter and the device's peak bf16 rate (None on a CPU or an unknown GPU)."""
        from transformers import AutoConfig

        try:
            counter = FlopsCounter(AutoConfig.from_pretrained(self.model_path,
                                                              trust_remote_code=self.cfg.model.trust_remote_code))
        except (OSError, ValueError):  # a model type the count does not know: no MFU, training goes on
            return None
        peak = None
        if self.cfg.trainer.device != "cpu" and torch.cuda.is_available():
            peak = peak_tflops(torch.cuda.get_device_name(0))
        return counter, peak

    def _perf_metrics(self, lengths: list[int], times: dict[str, float], seconds: float) -> dict[str, float]:
        """Tokens per second per device, each stage's share of the step and, on a known GPU, the model FLOPs
        utilisation of the actor's passes (``rlx.run.metrics``)."""
        devices = max(getattr(self.actor, "world_size", 1), 1)
        m = {"perf/throughput": sum(lengths) / max(seconds, 1e-9) / devices}
        for key, t in times.items():
            m[f"perf/time_share/{key.split('/', 1)[1]}"] = t / max(seconds, 1e-9)
        if self.flops is not None:
            counter, peak = self.flops
            passes = {"update_actor": 3.0 * self.cfg.actor.ppo_epochs, "old_log_prob": 1.0, "ref": 1.0}
            m.update(mfu_metrics(counter, lengths, times, passes, devices, peak))
        return m

    def _step_metrics(self, batch: Batch, timer: Timer, seconds: float) -> dict[str, float]:
        scores = batch["scores"]
        resp_len = batch["response_mask"].sum(-1).float()
        prompt_len = batch["prompt_mask"].sum(-1).float()
        tokens = float(resp_len.sum() + prompt_len.sum())
        m: dict[str, float] = {
            "reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            "reward/max": float(scores.max()), "reward/min": float(scores.min()),
            "response_length/mean": float(resp_len.mean()), "response_length/max": float(resp_len.max()),
            "response_length/min": float(resp_len.min()),
            "response_length/clip_ratio": float((resp_len >= self.sampling.max_tokens).float().mean()),
            "prompt_length/mean": float(prompt_len.mean()),
            "timing/step": seconds, "perf/total_tokens": tokens,
            "perf/tokens_per_second": tokens / max(seconds, 1e-9),
            "progress/epoch": float(self.loader.epoch), "progress/total_steps": float(self.total_steps),
        }
        for key in batch.tensors:
            if key.startswith("reward_extra/"):
                m[f"reward/{key.split('/', 1)[1]}"] = float(batch[key].mean())
        m.update(episode_metrics(batch))
        m.update(timer.times)
        m.update(self._perf_metrics((resp_len + prompt_len).long().tolist(), timer.times, seconds))
        return m

    def _log_samples(self, batch: Batch) -> None:
        k = self.cfg.trainer.log_samples
        if not k:
            return
        rows = [{"prompt": batch["prompt_text"][i], "response": batch["response_text"][i],
                 "ground_truth": batch["ground_truth"][i], "reward": float(batch["scores"][i])}
                for i in range(min(k, len(batch)))]
        for name in list(self.loggers):
            self._call_logger(name, "log_samples", rows, self.step)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for name in list(self.loggers):
            self._call_logger(name, "log", metrics, step)

    def _call_logger(self, name: str, method: str, *args: Any) -> None:
        """A logger that raises is reported and switched off; the run and the other loggers go on
        (metrics.jsonl, when on, still holds every step)."""
        try:
            getattr(self.loggers[name], method)(*args)
        except Exception as exc:
            del self.loggers[name]
            print(f"Warning: logger {name!r} failed in {method} at step {self.step} ({describe_exception(exc)}); "
                  f"it is switched off for the rest of the run. Still logging to: "
                  f"{', '.join(self.loggers) or 'nothing'}.", file=sys.stderr)

    # -- validation ---------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        assert self.val_set is not None
        cfg = self.cfg
        params = SamplingParams(n=cfg.rollout.val_n, temperature=cfg.rollout.val_temperature,
                                top_p=cfg.rollout.top_p if cfg.rollout.val_top_p is None else cfg.rollout.val_top_p,
                                top_k=cfg.rollout.top_k if cfg.rollout.val_top_k is None else cfg.rollout.val_top_k,
                                max_tokens=cfg.data.max_response_length,
                                greedy=cfg.rollout.val_temperature == 0)
        # Per data source and overall: acc, mean@n (= reward/mean), pass@k, maj@n (rlx.run.evaluation).
        from rlx.run.evaluation import evaluate, flatten, summarize

        self._settle_rollouts(push=True)  # asynchronous RL: the engine is idle and holds this step's policy
        phase = self._wake_rollout()  # after a step without an update the engine still sleeps
        records = evaluate(self.val_set.examples, generate=self._generate,
                           score=partial(self.reward.call, "score"), params=params,
                           batch_size=cfg.data.val_batch_size, pad_token_id=self.tokenizer.pad_token_id,
                           vision=self.vision)
        return {**flatten(summarize(records), prefix="val"), **phase}

    # -- checkpoints --------------------------------------------------------------------------
    def save(self) -> Path:
        # Asynchronous RL: the generation under way ends first (the loader's position and the random state then
        # follow its prompts and draws), its rollouts are saved with the checkpoint, and the engine takes this
        # step's weights, which is what a resumed run starts from.
        self._settle_rollouts(push=True)
        pending = self.ahead.ready if self.ahead is not None else None
        if pending is not None and self.finished_pool is not None and len(self.finished_pool):
            # Partial rollouts: the finished groups waiting for a step are saved with the others.
            pending.batch = concat_rollouts([b for b in (self.finished_pool, pending.batch) if len(b)],
                                            self.tokenizer.pad_token_id)
            self.finished_pool = None

        def write(tmp: Path) -> None:
            self.actor.call_all(TrainWorker.save_checkpoint, str(tmp / "actor"))
            if self.critic is not None:
                self.critic.call_all(TrainWorker.save_checkpoint, str(tmp / "critic"))
            if pending is not None:
                save_rollouts(tmp / ROLLOUTS_FILE, pending)

        state: dict[str, Any] = {"loader": self.loader.state_dict(), "policy_version": self.version}
        if hasattr(self.algorithm, "state_dict"):  # e.g. an adaptive KL coefficient
            state["algorithm"] = self.algorithm.state_dict()
        path = checkpoint.save(self.ckpt_root, self.step, write, state, keep=self.cfg.trainer.max_checkpoints_to_keep)
        self.saved_step = self.step
        self.pm.call_lifecycle("rlx_on_checkpoint", step=self.step, path=str(path))
        return path

    def _load(self, path: Path) -> None:
        state = checkpoint.read_state(path)
        self.actor.call_all(TrainWorker.load_checkpoint, str(path / "actor"))
        if self.critic is not None:
            if not (path / "critic").is_dir():
                raise UserError(f"{path} has no critic, but algorithm {self.cfg.algorithm.name!r} needs one.",
                                "Resume with the algorithm the run was started with, or start a new run.")
            self.critic.call_all(TrainWorker.load_checkpoint, str(path / "critic"))
        if "algorithm" in state and hasattr(self.algorithm, "load_state_dict"):
            self.algorithm.load_state_dict(state["algorithm"])
        self.loader.load_state_dict(state["loader"])
        self.step = self.saved_step = int(state["step"])
        self.version = int(state.get("policy_version", self.step))
        if (path / ROLLOUTS_FILE).is_file():
            rollouts = load_rollouts(path / ROLLOUTS_FILE)
            if self.ahead is not None:
                self.ahead.ready = rollouts
            else:
                self.resumed_rollouts = rollouts
        print(f"Resuming from {path} (step {self.step}).")
        if self.step >= self.total_steps:
            print(f"Run already finished at step {self.step}/{self.total_steps}; nothing to do. To train longer "
                  f"set trainer.total_steps={self.step + self.total_steps}; for a new run set trainer.experiment=NAME.")

    def save_hf(self, target: Path) -> None:
        """Write the final policy in Hugging Face format, atomically (temp folder, then rename)."""
        tmp = target.with_name(f".tmp-{target.name}")
        checkpoint.remove_tree(tmp)  # a planted link is removed, never followed
        checkpoint.make_dir(tmp)
        self.actor.call_all(TrainWorker.save_pretrained, str(tmp), self.tokenizer)
        copy_processor_files(self.model_path, str(tmp))
        if is_private(target.parent):  # the run folder is owner-only: so is the model written into it
            make_tree_private(tmp)
        checkpoint.replace_dir(tmp, target)
