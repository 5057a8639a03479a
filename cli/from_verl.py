"""Translate a verl run (its ``main_ppo`` command line or a YAML of Hydra keys) into an rlx config.

``rlx config from-verl "<verl command line or YAML path>"`` prints the rlx config; ``rlx train --from-verl``
runs it. Every verl key given is either

- **mapped** to rlx's key, with its value converted where the two differ in meaning (``trainer.save_freq=-1``
  means "never" in verl and is ``0`` in rlx, ``algorithm.adv_estimator=gae`` is rlx's ``ppo`` algorithm, ...),
- **ignored** with a reason, when it changes where or how fast things run but not what is computed
  (offloading, memory fractions, tensor-parallel sizes of the engine, profiling), or
- **unmapped**, with a reason: rlx has no counterpart, so the run would not be the same. The command stops
  (exit 2) naming each one, unless ``--allow-unmapped``.

verl's defaults that differ from rlx's (a batch of 1024 prompts, 30 epochs, one sample per prompt, no KL
loss, validation before training, ...) are written into the translation when the command line does not
set them, so the rlx run is the verl run. ``docs/from-verl.md`` has the whole key map.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlx.cli import verl_shell
from rlx.errors import UserError

# ---------------------------------------------------------------------------------------------
# Reading the verl source
_STOP_TOKENS = {"|", "||", "&&", ";", "&", "|&"}


def _parse_value(raw: str) -> Any:
    from rlx.config import parse_value

    return parse_value(os.path.expandvars(raw))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


_INTERPOLATION = re.compile(r"\$\{([^}]+)\}")


def _resolve_interpolations(keys: dict[str, Any]) -> dict[str, Any]:
    """Hydra's ``${a.b}`` references to other keys of the same source, resolved (a few rounds for chains)."""
    out = dict(keys)
    for _ in range(5):
        changed = False
        for key, value in out.items():
            if not isinstance(value, str) or "${" not in value:
                continue
            whole = _INTERPOLATION.fullmatch(value)
            if whole and whole.group(1) in out and not isinstance(out[whole.group(1)], str):
                out[key], changed = out[whole.group(1)], True
                continue
            new = _INTERPOLATION.sub(lambda m: str(out[m.group(1)]) if m.group(1) in out else m.group(0), value)
            if new != value:
                out[key], changed = new, True
        if not changed:
            break
    return out


# verl's own config files, which its defaults are: what rlx translates against (docs/from-verl.md).
_VERL_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer")


def _yaml_keys(path: Path, label: str) -> dict[str, Any]:
    """A YAML file of verl's Hydra keys, flattened (its ``defaults`` and ``hydra`` sections left out)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise UserError(f"--from-verl {label}: not a text file (it is not UTF-8); a verl YAML config is text.",
                        "Give the path of a verl YAML config, or a verl command line in quotes.") from None
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"--from-verl {label}: cannot read it as YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"--from-verl {label}: the top level must be a mapping of verl sections.")
    return _flatten({k: v for k, v in data.items() if k not in ("defaults", "hydra")})


def _config_file(read: verl_shell.ShellRead, notes: list[str] | None) -> dict[str, Any]:
    """The keys of the config file a script names with ``--config-path``/``--config-name`` (Hydra's own
    options): verl's multi-turn examples keep settings such as ``multi_turn.enable`` there. Read as data when
    it is on this machine (the command line's settings win); verl's own configs are its defaults."""
    options: dict[str, str] = {}
    words = [w.text for w in read.words]
    for i, text in enumerate(words):
        for flag, option in (("--config-path", "path"), ("--config-name", "name"), ("-cp", "path"),
                             ("-cn", "name")):
            if text.startswith(flag + "="):
                options[option] = text.partition("=")[2]
            elif text == flag and i + 1 < len(words):
                options[option] = words[i + 1]
    name, folder = options.get("name", "").strip("'\""), options.get("path", "").strip("'\"")
    if Path(name).stem == "ppo_megatron_trainer":  # verl's Megatron config: its roles' strategy is megatron
        if notes is not None:
            notes.append(f"--config-name={name}: verl's Megatron defaults, whose actor strategy is megatron")
        return {AA + "strategy": "megatron"}
    if not name or Path(name).stem in _VERL_CONFIGS:
        return {}
    if not os.path.isabs(os.path.expanduser(folder)):  # Hydra: relative to verl's trainer module, not here
        if notes is not None:
            notes.append(f"--config-name={name}: its folder ({folder or 'verl/trainer/config'}) is relative to "
                         "verl's trainer module, so its settings are not read (give --config-path as an absolute "
                         "path, as verl's scripts do with $(pwd), or give the settings on the command line)")
        return {}
    path = Path(os.path.expanduser(folder)) / (name if name.endswith((".yaml", ".yml")) else name + ".yaml")
    if not path.is_file():
        if notes is not None:
            notes.append(f"--config-name={name}: verl's config file {path} is not on this machine, so its settings "
                         "are not read (run rlx from the folder the script expects, or give them on the command "
                         "line)")
        return {}
    if notes is not None:
        notes.append(f"--config-name={name}: the settings of {path} are read, under the command line's")
    keys = _yaml_keys(path, f"--config-name={name} ({path})")
    if "ppo_megatron_trainer" in _defaults_of(path) and AA + "strategy" not in keys:
        if notes is not None:
            notes.append(f"--config-name={name}: its defaults are verl's Megatron config, whose actor strategy is "
                         "megatron")
        keys = {AA + "strategy": "megatron", **keys}
    return keys


def _defaults_of(path: Path) -> list[str]:
    """The config names in a verl config file's Hydra ``defaults`` list (``- name`` or ``- group: name``)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []
    defaults = data.get("defaults") if isinstance(data, dict) else None
    out: list[str] = []
    for item in defaults if isinstance(defaults, list) else []:
        values = item.values() if isinstance(item, dict) else [item]
        out += [Path(str(v)).stem for v in values if isinstance(v, str)]
    return out


def _trainer_keys(read: verl_shell.ShellRead, notes: list[str] | None = None) -> dict[str, Any]:
    """The ``KEY=VALUE`` overrides among the trainer's words (``+KEY``/``++KEY`` too; ``~KEY`` deletions),
    over the keys of the config file the words name; a value that needs a variable nothing sets, or a command
    rlx will not run, is named with its key."""
    keys: dict[str, Any] = {}
    for word in read.words:
        text = word.text
        if text.startswith("~"):  # Hydra's deletion of a default key (reported as unmapped)
            keys[text.partition("=")[0]] = None
            continue
        if text and not text.strip():  # ``\ `` then a comment: bash passes a space and ends the command there
            after = f" (after {list(keys)[-1]})" if keys else ""
            raise UserError(f"--from-verl: the verl command has an argument that is only a space{after}: a backslash "
                            "followed by a space (a comment after a line-continuation backslash) makes bash pass "
                            "' ' and end the command at that line, so the lines below it are not part of the "
                            "command; verl's Hydra refuses the ' ' too.",
                            "Move the comment off that line (or delete it) so that the backslash ends the line.")
        key, eq, raw = text.partition("=")
        if not eq or not key or key.startswith("-") or "$" in key:
            continue
        key = key.lstrip("+")
        if word.commands:
            raise UserError(f"--from-verl: {key} is set by running a command ($({word.commands[0]})), which rlx "
                            "never runs.", f"Put the value itself in the script, or give {key} on the rlx command "
                            "line and leave it out of the script.")
        if word.unset:
            names = ", ".join(f"${name}" for name in dict.fromkeys(word.unset))
            raise UserError(f"--from-verl: {key} needs {names}, which the script does not set and the environment "
                            "does not have.", f"Set it when you run rlx ({word.unset[0]}=... rlx train --from-verl "
                            f"...), or set it in the script.")
        keys[key] = _parse_value(raw)
    if not keys:
        raise UserError("--from-verl: the verl command sets no KEY=VALUE settings.",
                        "Give the verl command with its settings, e.g. python3 -m verl.trainer.main_ppo "
                        "data.train_files=... actor_rollout_ref.model.path=...")
    return _resolve_interpolations({**_config_file(read, notes), **keys})


def read_verl_source(source: str, environ: Mapping[str, str] | None = None,
                     notes: list[str] | None = None) -> dict[str, Any]:
    """The verl keys a command line (or a YAML file of Hydra keys) sets: ``{dotted key: value}``.

    In a command line, ``KEY=VALUE`` words after the program are Hydra overrides (``+KEY``/``++KEY`` too,
    and ``~KEY`` deletions, which rlx cannot follow);
    ``VAR=VALUE`` words before it are environment settings and are skipped, as are the program, its
    options, ``$@`` and everything from the first pipe or ``;`` on. ``$HOME``-style variables are
    expanded as the shell would. A YAML file's nested keys are flattened (its ``defaults`` and ``hydra``
    sections left out).
    """
    text = source.strip()
    path = Path(os.path.expanduser(text))
    if "\n" not in text and text.endswith((".yaml", ".yml")) and (path.is_file() or " " not in text):
        if not path.is_file():
            raise UserError(f"--from-verl {text}: no such YAML file.",
                            "Give the path of a verl YAML config, or a verl command line in quotes.")
        return _resolve_interpolations(_yaml_keys(path, text))
    read = verl_shell.trainer_words(text, environ)  # environ: the variables a script reads (os.environ)
    if read is not None:  # a script or command line that starts verl's trainer: read as bash would expand it
        return _trainer_keys(read, notes)
    try:
        words = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise UserError(f"--from-verl: cannot split the command line into words ({exc}).",
                        "Check its quotes; give it as one quoted argument.") from None
    keys: dict[str, Any] = {}
    seen_program = False
    for word in words:
        if word in _STOP_TOKENS or word.startswith((">", "2>", "1>")):
            break
        if word.startswith("~") and seen_program:  # Hydra's deletion of a default key
            keys[word.partition("=")[0]] = None
            continue
        key, eq, raw = word.partition("=")
        if not eq or not key or key.startswith("-") or "$" in key:
            if word != "$@" and not word.startswith("-"):
                seen_program = True
            continue
        if not seen_program and "." not in key:
            continue  # VAR=VALUE before the program: the environment of the command
        keys[key.lstrip("+")] = _parse_value(raw)
    if not keys:
        raise UserError("--from-verl: no KEY=VALUE settings found in the command line.",
                        "Pass the whole verl command in quotes, e.g. --from-verl \"python3 -m verl.trainer.main_ppo "
                        "data.train_files=... actor_rollout_ref.model.path=...\", or a YAML file.")
    return _resolve_interpolations(keys)


# ---------------------------------------------------------------------------------------------
# The translation
@dataclass
class Translation:
    """rlx settings (dotted keys) from verl keys, with what was converted, ignored and left unmapped."""

    settings: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # rlx key -> the verl key (or "verl default")
    notes: list[str] = field(default_factory=list)  # conversions worth knowing
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (verl key, why it changes nothing here)
    unmapped: list[tuple[str, str]] = field(default_factory=list)  # (verl key, why rlx cannot follow it)

    def set(self, key: str, value: Any, source: str) -> None:
        self.settings[key] = value
        self.sources[key] = source

    def tree(self) -> dict[str, Any]:
        from rlx.config import set_dotted

        out: dict[str, Any] = {}
        for key, value in self.settings.items():
            set_dotted(out, key, value)
        return out

    def overrides(self) -> list[str]:
        """The settings as ``KEY=VALUE`` overrides (values as JSON, which rlx reads as YAML)."""
        return [f"{key}={json.dumps(value)}" for key, value in self.settings.items()]

    def to_yaml(self) -> str:
        import yaml

        lines = ["# rlx config translated from a verl run (rlx config from-verl)."]
        for note in self.notes:
            lines.append(f"# note: {note}")
        for key, why in self.ignored:
            lines.append(f"# ignored: {key} ({why})")
        for key, why in self.unmapped:
            lines.append(f"# UNMAPPED: {key} ({why})")
        return "\n".join(lines) + "\n" + yaml.safe_dump(self.tree(), sort_keys=False)

    def unmapped_error(self) -> UserError:
        listed = "; ".join(f"{key} ({why})" for key, why in self.unmapped)
        return UserError(f"{len(self.unmapped)} verl key(s) have no rlx counterpart: {listed}.",
                         "Remove them from the verl command, or pass --allow-unmapped to run without them "
                         "(docs/from-verl.md lists every key rlx maps).")


class _Unmapped(Exception):
    pass


class _Ignored(Exception):
    pass


AA = "actor_rollout_ref.actor."
RO = "actor_rollout_ref.rollout."
REF = "actor_rollout_ref.ref."
MODEL = "actor_rollout_ref.model."
_DAPO_KWARGS = "reward_model.reward_kwargs."
OVERLONG = _DAPO_KWARGS + "overlong_buffer_cfg."

# verl key -> rlx key, same meaning and value.
DIRECT: dict[str, str] = {
    "data.train_files": "data.train_files",
    "data.val_files": "data.val_files",
    "data.train_batch_size": "data.train_batch_size",
    "data.val_batch_size": "data.val_batch_size",
    "data.max_prompt_length": "data.max_prompt_length",
    "data.max_response_length": "data.max_response_length",
    "data.filter_overlong_prompts": "data.filter_overlong_prompts",
    "data.prompt_key": "data.prompt_key",
    "data.shuffle": "data.shuffle",
    "data.seed": "trainer.seed",
    MODEL + "path": "model.path",
    MODEL + "tokenizer_path": "model.tokenizer_path",
    MODEL + "trust_remote_code": "model.trust_remote_code",
    MODEL + "enable_gradient_checkpointing": "model.gradient_checkpointing",
    MODEL + "use_remove_padding": "actor.use_remove_padding",
    MODEL + "lora_alpha": "model.lora_alpha",
    MODEL + "target_modules": "model.target_modules",
    MODEL + "exclude_modules": "model.exclude_modules",
    AA + "optim.lr": "actor.optim.lr",
    AA + "optim.weight_decay": "actor.optim.weight_decay",
    AA + "optim.betas": "actor.optim.betas",
    AA + "optim.min_lr_ratio": "actor.optim.min_lr_ratio",
    AA + "optim.clip_grad": "actor.optim.grad_clip",
    AA + "grad_clip": "actor.optim.grad_clip",
    AA + "ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    AA + "ppo_micro_batch_size_per_gpu": "actor.micro_batch_size_per_device",
    AA + "use_dynamic_bsz": "actor.use_dynamic_bsz",
    AA + "ppo_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu",
    AA + "ppo_epochs": "actor.ppo_epochs",
    AA + "ulysses_sequence_parallel_size": "actor.ulysses_sequence_parallel_size",
    AA + "shuffle": "actor.shuffle",
    AA + "clip_ratio": "algorithm.clip_ratio",
    AA + "clip_ratio_low": "algorithm.clip_ratio_low",
    AA + "clip_ratio_high": "algorithm.clip_ratio_high",
    AA + "clip_ratio_c": "algorithm.clip_ratio_c",
    AA + "policy_loss.loss_mode": "algorithm.policy_loss",
    AA + "policy_loss.clip_cov_ratio": "algorithm.clip_cov_ratio",
    AA + "policy_loss.clip_cov_lb": "algorithm.clip_cov_lb",
    AA + "policy_loss.clip_cov_ub": "algorithm.clip_cov_ub",
    AA + "policy_loss.kl_cov_ratio": "algorithm.kl_cov_ratio",
    AA + "policy_loss.ppo_kl_coef": "algorithm.ppo_kl_coef",
    AA + "tau_pos": "algorithm.tau_pos",
    AA + "tau_neg": "algorithm.tau_neg",
    AA + "use_kl_loss": "algorithm.use_kl_loss",
    AA + "kl_loss_coef": "algorithm.kl_loss_coef",
    AA + "kl_loss_type": "algorithm.kl_loss_type",
    AA + "entropy_coeff": "algorithm.entropy_coeff",
    AA + "loss_agg_mode": "algorithm.loss_agg_mode",
    RO + "n": "rollout.n",
    RO + "temperature": "rollout.temperature",
    RO + "top_p": "rollout.top_p",
    RO + "top_k": "rollout.top_k",
    RO + "val_kwargs.temperature": "rollout.val_temperature",
    RO + "val_kwargs.n": "rollout.val_n",
    RO + "val_kwargs.top_p": "rollout.val_top_p",
    RO + "val_kwargs.top_k": "rollout.val_top_k",
    "critic.model.path": "critic.model_path",
    "critic.model.use_remove_padding": "critic.use_remove_padding",
    "critic.optim.lr": "critic.optim.lr",
    "critic.optim.weight_decay": "critic.optim.weight_decay",
    "critic.optim.betas": "critic.optim.betas",
    "critic.optim.min_lr_ratio": "critic.optim.min_lr_ratio",
    "critic.optim.clip_grad": "critic.optim.grad_clip",
    "critic.grad_clip": "critic.optim.grad_clip",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size_per_device",
    "critic.forward_micro_batch_size_per_gpu": "critic.forward_micro_batch_size_per_device",
    "critic.ppo_epochs": "critic.ppo_epochs",
    "critic.cliprange_value": "critic.cliprange_value",
    "critic.use_dynamic_bsz": "critic.use_dynamic_bsz",
    "critic.ulysses_sequence_parallel_size": "critic.ulysses_sequence_parallel_size",
    "critic.ppo_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu",
    "critic.forward_max_token_len_per_gpu": "critic.forward_max_token_len_per_gpu",
    "algorithm.gamma": "algorithm.gamma",
    "algorithm.lam": "algorithm.lam",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "algorithm.use_kl_in_reward": "algorithm.use_kl_in_reward",
    "algorithm.kl_penalty": "algorithm.kl_penalty",
    "algorithm.kl_ctrl.type": "algorithm.kl_ctrl.type",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_ctrl.kl_coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl_ctrl.target_kl",
    "algorithm.kl_ctrl.horizon": "algorithm.kl_ctrl.horizon",
    "algorithm.filter_groups.enable": "algorithm.filter_groups",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.max_num_gen_batches",
    **{f"algorithm.rollout_correction.{k}": f"algorithm.rollout_correction.{k}"
       for k in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                 "rollout_rs_threshold", "loss_type")},
    "trainer.project_name": "trainer.project",
    "trainer.experiment_name": "trainer.experiment",
    "trainer.test_freq": "trainer.test_freq",
    "trainer.val_before_train": "trainer.val_before_train",
    "trainer.critic_warmup": "critic.warmup_steps",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_checkpoints_to_keep",
    "reward_model.model.path": "reward.path",
    "reward_model.micro_batch_size_per_gpu": "reward.batch_size",
    "reward_model.max_length": "reward.max_length",
    "reward_model.model.trust_remote_code": "reward.trust_remote_code",
    "custom_reward_function.path": "reward.path",
    "custom_reward_function.name": "reward.function",
    "custom_reward_function.reward_kwargs": "reward.kwargs",
}

_PLACEMENT = "placement, memory or speed only: what is computed is the same"
# Keys (or key prefixes ending in ".") that change where or how fast things run, not the results.
IGNORED: dict[str, str] = {
    AA + "fsdp_config.": _PLACEMENT, REF + "fsdp_config.": _PLACEMENT, "critic.model.fsdp_config.": _PLACEMENT,
    "critic.fsdp_config.": _PLACEMENT, "reward_model.model.fsdp_config.": _PLACEMENT,
    AA + "checkpoint.": "what a checkpoint holds: rlx saves what a resume needs",
    "critic.checkpoint.": "what a checkpoint holds: rlx saves what a resume needs",
    AA + "use_torch_compile": _PLACEMENT, AA + "entropy_from_logits_with_chunking": _PLACEMENT,
    AA + "entropy_checkpointing": _PLACEMENT, AA + "data_loader_seed": "rlx seeds everything from trainer.seed",
    "critic.strategy": "rlx trains the critic with the actor's backend",
    REF + "strategy": "rlx computes the reference with the actor's backend",
    REF + "megatron.": "rlx lays the reference out as the actor (backend.*): " + _PLACEMENT,
    "critic.megatron.": "rlx lays the critic out as the actor (backend.*): " + _PLACEMENT,
    AA + "optim.total_training_steps": "filled in by verl at run time",
    RO + "free_cache_engine": _PLACEMENT, RO + "load_format": _PLACEMENT,
    RO + "enable_chunked_prefill": _PLACEMENT, RO + "layered_summon": _PLACEMENT,
    RO + "mode": "verl's sync or async inference servers: rlx's runner batches the turns of the episodes "
    "itself; what is sampled is the same",
    RO + "trace.": "verl's rollout tracing (mlflow, weave): logging only",
    RO + "server.": "verl's HTTP inference-server client settings (timeouts, retries, connections): " + _PLACEMENT,
    RO + "sglang_rollout_mode": "verl's in-process or server SGLang: rlx's engines take the same sampling "
    "parameters either way; " + _PLACEMENT,
    RO + "prompt_length": "rlx takes it from data.max_prompt_length",
    RO + "response_length": "rlx takes it from data.max_response_length",
    RO + "calculate_log_probs": "rlx always keeps the engine's log-probs",
    MODEL + "use_shm": _PLACEMENT, MODEL + "use_fused_kernels": _PLACEMENT,
    "critic.model.enable_gradient_checkpointing": "rlx has one switch for every model: model.gradient_checkpointing",
    "critic.model.tokenizer_path": "the critic uses the policy's tokenizer",
    "reward_model.model.input_tokenizer": "rlx's reward model reads text, through its own chat template",
    "data.truncation": "rlx never truncates a prompt: it drops it (filter_overlong_prompts) or fails",
    "data.return_raw_chat": "rlx always formats prompts, and its agent loops their turns, from the chat "
    "messages",
    "data.return_full_prompt": "rlx always formats prompts from the chat messages",
    "data.dataloader_num_workers": _PLACEMENT,
    "trainer.logger": "", "trainer.n_gpus_per_node": "", "trainer.nnodes": "",
    "trainer.balance_batch": _PLACEMENT, "trainer.ray_wait_register_center_timeout": _PLACEMENT,
    "trainer.log_val_generations": "logging only",
    "trainer.del_local_ckpt_after_load": "", "trainer.profile_steps": _PLACEMENT, "global_profiler.": _PLACEMENT,
    "ray_kwargs.": _PLACEMENT, "ray_init.": _PLACEMENT, "trainer.device": "",
    "reward_model.enable": "",
    RO + "engine_kwargs.": "the engine's own internals (caches, attention kernels): " + _PLACEMENT,
    RO + "max_model_len": "the engine's context limit: rlx sizes it from the prompt and response lengths",
    RO + "multi_stage_wake_up": _PLACEMENT, RO + "data_parallel_size": _PLACEMENT,
    REF + "ulysses_sequence_parallel_size": "rlx computes the reference with the actor's layout: " + _PLACEMENT,
    REF + "use_torch_compile": _PLACEMENT, AA + "profiler.": _PLACEMENT, REF + "profiler.": _PLACEMENT,
    "critic.profiler.": _PLACEMENT, "actor_rollout_ref.nccl_timeout": _PLACEMENT,
    "trainer.use_legacy_worker_impl": "verl's choice between two implementations of the same workers",
    "reward_model.num_workers": _PLACEMENT, "reward_model.use_reward_loop": "verl's choice between two "
    "implementations of the same reward computation",
    "trainer.max_critic_ckpt_to_keep": "rlx keeps trainer.max_checkpoints_to_keep checkpoints of every role",
    RO + "expert_parallel_size": "the engine's expert parallelism (how the inference engine spreads a "
    "mixture-of-experts model's experts over its GPUs): " + _PLACEMENT,
    "data.filter_overlong_prompts_workers": "processes that filter the prompts: " + _PLACEMENT,
    REF + "entropy_from_logits_with_chunking": _PLACEMENT, REF + "entropy_checkpointing": _PLACEMENT,
    "reward_model.model.use_remove_padding": _PLACEMENT,
    MODEL + "fused_kernel_options.": "the kernels behind use_fused_kernels: " + _PLACEMENT,
    MODEL + "enable_activation_offload": _PLACEMENT,
    AA + "use_prefix_grouper": "verl's shared-prefix forward pass computes each prompt once for its group of "
    "responses: the same log-probs and gradients, " + _PLACEMENT,
    RO + "over_sample_rate": "not read by verl (b178a3cd5): its rollout config has the field but nothing reads it, "
    "so verl finishes every sampled response, as rlx does",
    RO + "disable_log_stats": "the engine's own logging", RO + "prometheus.": "the engine's metrics server: logging "
    "only", RO + "skip_tokenizer_init": "whether the engine loads a tokenizer of its own (it takes and returns "
    "token ids either way): " + _PLACEMENT,
    RO + "checkpoint_engine.": "how verl moves the weights to the engine (transport backend): " + _PLACEMENT,
    AA + "calculate_sum_pi_squared": "verl's switch for the sum over the vocabulary of pi^2 in its old-log-prob "
    "pass: rlx's pass computes it whenever the advantage estimator requires it (the optimal-token-baseline ones)",
}

# verl's engine settings -> the option of each rlx engine that has one; with an engine that has none, the
# setting is ignored (it is about memory or placement, not what is sampled).
ENGINE_OPTIONS: dict[str, dict[str, str]] = {
    RO + "gpu_memory_utilization": {"vllm": "gpu_memory_utilization", "sglang": "mem_fraction_static"},
    RO + "tensor_model_parallel_size": {"vllm": "tensor_parallel_size", "sglang": "tp_size"},
    RO + "enforce_eager": {"vllm": "enforce_eager"},
    RO + "max_num_batched_tokens": {"vllm": "max_num_batched_tokens"},
    RO + "max_num_seqs": {"vllm": "max_num_seqs"},
    RO + "dtype": {"vllm": "dtype", "sglang": "dtype", "hf": "dtype"},
}

# verl's defaults where rlx's differ, written into the translation when the verl source leaves them out.
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    "actor.ppo_mini_batch_size": 256,
    "rollout.n": 1,
    "trainer.total_epochs": 30,
    "trainer.val_before_train": True,
    "trainer.save_freq": 0,
    "algorithm.use_kl_loss": False,
    "data.filter_overlong_prompts": False,
}


def _core_or_option_key_exists(key: str, settings: dict[str, Any], pm: Any) -> bool:
    """Whether rlx has ``key``: a field of the core config, or an option of the plugin its section names."""
    from pydantic import BaseModel

    from rlx.config import RLXConfig
    from rlx.validate import COMPONENT_SECTIONS

    parts = key.split(".")
    model: Any = RLXConfig
    for i, part in enumerate(parts):
        fields = model.model_fields if isinstance(model, type) and issubclass(model, BaseModel) else {}
        if part in fields:
            model = fields[part].annotation
            continue
        if i == 1 and parts[0] in COMPONENT_SECTIONS and pm is not None:
            default = RLXConfig.model_fields[parts[0]].default_factory().name  # type: ignore[misc]
            name = settings.get(f"{parts[0]}.name", default)
            try:
                options = pm.get(COMPONENT_SECTIONS[parts[0]], name).load_config_model()
            except Exception:
                return False
            return options is not None and part in options.model_fields
        return False
    return True


def _algorithm_for(estimator: str) -> tuple[str, str | None]:
    """verl's ``algorithm.adv_estimator`` -> (rlx algorithm, rlx adv_estimator or None)."""
    named = {"grpo": "grpo", "gae": "ppo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_plus_plus",
             "remax": "remax"}
    if estimator in named:
        return named[estimator], None
    return "grpo", estimator


def _save_freq(value: Any, t: Translation) -> None:
    if isinstance(value, int) and value <= 0:
        t.notes.append(f"trainer.save_freq={value}: verl saves nothing; rlx writes that as trainer.save_freq=0")
        value = 0
    t.set("trainer.save_freq", value, "trainer.save_freq")


def _loggers(value: Any, t: Translation) -> None:
    names = [value] if isinstance(value, str) else list(value or [])
    out = []
    for name in names:
        rlx_name = {"file": "jsonl"}.get(str(name), str(name))
        if rlx_name not in out:
            out.append(rlx_name)
    if "jsonl" not in out:
        out.append("jsonl")  # metrics.jsonl: what rlx plot and rlx replay read
    t.set("trainer.loggers", out, "trainer.logger")


def _output_dir(value: Any, t: Translation) -> None:
    fields = {"${trainer.project_name}": "{project}", "${trainer.experiment_name}": "{experiment}"}
    parts = re.split(r"(\$\{trainer\.project_name\}|\$\{trainer\.experiment_name\})", str(value))
    if any("${" in part for part in parts if part not in fields):
        raise _Unmapped(f"an interpolation rlx cannot resolve: {value}")
    # rlx fills {project} and {experiment} in; a brace of the path itself is doubled to stay a brace
    text = "".join(fields.get(part, part.replace("{", "{{").replace("}", "}}")) for part in parts)
    t.set("trainer.output_dir", text, "trainer.default_local_dir")


def _resume(value: Any, t: Translation) -> None:
    modes = {"auto": "auto", "disable": "never"}
    if value not in modes:
        raise _Unmapped("rlx resumes from its own run folder's checkpoints (trainer.resume=auto|never|must)")
    t.set("trainer.resume", modes[value], "trainer.resume_mode")


def _resume_path(value: Any, verl: dict[str, Any]) -> None:
    if verl.get("trainer.resume_mode", "auto") != "resume_path":
        raise _Ignored("verl reads it only with trainer.resume_mode=resume_path")
    raise _Unmapped("rlx resumes from its own run folder's checkpoints, not from a folder given by path")


# verl's own test sampler, which its curriculum examples name: a plain random order of the prompts (a torch
# RandomSampler, reshuffled each epoch; its update() does nothing).
RANDOM_SAMPLER = ("pkg://tests.utils.dataset.test_create_rl_sampler_on_cpu", "RandomCurriculumSampler")


def _sampler(t: Translation, verl: dict[str, Any], key: str) -> None:
    given = (verl.get("data.sampler.class_path"), verl.get("data.sampler.class_name"))
    if given[0] is None:
        raise _Ignored("no class_path: verl's own sampler (data.shuffle)")
    if given != RANDOM_SAMPLER:
        raise _Unmapped(f"a custom sampler class ({given[1]} from {given[0]}, e.g. a curriculum that orders the "
                        "prompts); rlx's loader shuffles the prompts or keeps their order (data.shuffle)")
    raise _Ignored(f"verl's {RANDOM_SAMPLER[1]} (its test sampler) draws the prompts in a random order each epoch, "
                   "as data.shuffle=true does (with rlx's seed)")


def _random_sampler(verl: dict[str, Any], t: Translation) -> None:
    """verl's random test sampler replaces its own (data.shuffle is then not read): rlx shuffles."""
    if (verl.get("data.sampler.class_path"), verl.get("data.sampler.class_name")) == RANDOM_SAMPLER:
        t.set("data.shuffle", True, "data.sampler.class_name")


def _remote_code(value: Any, t: Translation, source: str) -> None:
    """verl's data.trust_remote_code (the tokenizer's and processor's code) and the critic's: rlx has one
    switch for every model and tokenizer, model.trust_remote_code, which the translation leaves out."""
    if value in (False, None, "false", "False", 0):
        raise _Ignored("false: no code of the model folder runs")
    t.set("model.trust_remote_code", value, source)


def _bucket(value: Any, t: Translation, pm: Any) -> None:
    if not _positive(value) or not _core_or_option_key_exists("launcher.bucket_size_mb", t.settings, pm):
        raise _Ignored(f"the size of the pieces the weights reach the engine in: {_PLACEMENT}")
    t.set("launcher.bucket_size_mb", float(value), RO + "checkpoint_engine.update_weights_bucket_megabytes")


# megatron-core OptimizerConfig fields verl's override_optimizer_config sets that move the optimizer's
# work (to the CPU, overlapped with copies) without changing the update.
OPTIMIZER_PLACEMENT = ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                       "pin_cpu_grads", "pin_cpu_params", "use_torch_optimizer_for_cpu_offload")
# The dtypes of the precision-aware optimizer's states; megatron-core's default for each is float32.
OPTIMIZER_DTYPES = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
OVERRIDE_OPTIMIZER = AA + "optim.override_optimizer_config."


def _override_optimizer(key: str, value: Any, verl: dict[str, Any]) -> None:
    """verl's megatron optimizer settings (megatron-core OptimizerConfig fields): CPU offload and the
    precision-aware optimizer with float32 states are placement; anything else is named."""
    name = key.removeprefix(OVERRIDE_OPTIMIZER)
    if verl.get(AA + "strategy", "fsdp") != "megatron":
        raise _Unmapped("keyword arguments of verl's FSDP optimizer class, which rlx's optimizer does not take")
    if name in OPTIMIZER_PLACEMENT:
        raise _Ignored("megatron-core's optimizer CPU offload (the Adam update runs on the CPU, in float32, "
                       "as on the GPU): " + _PLACEMENT)
    if name == "use_precision_aware_optimizer":
        low = [d for d in OPTIMIZER_DTYPES if str(verl.get(OVERRIDE_OPTIMIZER + d, "float32")).removeprefix(
            "torch.") not in ("float32", "fp32", "None")]
        if value in (False, None) or not low:
            raise _Ignored("with its states in float32 (megatron-core's default) the update is Adam's in float32, "
                           "as rlx's megatron backend computes it: " + _PLACEMENT)
        raise _Unmapped(f"optimizer states below float32 ({', '.join(low)}): rlx's megatron backend keeps them "
                        "in float32")
    if name in OPTIMIZER_DTYPES:
        if str(value).removeprefix("torch.") in ("float32", "fp32", "None"):
            raise _Ignored("float32, megatron-core's default")
        raise _Unmapped(f"optimizer state dtype {value}: rlx's megatron backend keeps its optimizer states in "
                        "float32")
    raise _Unmapped("a megatron-core optimizer setting that rlx's megatron backend does not take")


def _total_steps(value: Any, t: Translation) -> None:
    if value is None:
        raise _Ignored("null: the epochs decide")
    t.set("trainer.total_steps", value, "trainer.total_training_steps")


def _lora_rank(value: Any, t: Translation) -> None:
    if not value:
        raise _Ignored("0: no LoRA, the whole model trains")
    t.set("model.lora_rank", value, MODEL + "lora_rank")


def _lora_adapter_path(value: Any, t: Translation) -> None:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise _Ignored("null: LoRA starts from new adapters")
    t.set("model.lora_adapter_path", str(value), MODEL + "lora_adapter_path")


# The LoRA settings a saved adapter carries: verl reads them from its adapter_config.json (peft's
# PeftModel.from_pretrained) and ignores the config's, as rlx does for the options left unset.
ADAPTER_SETTINGS = ("model.lora_rank", "model.lora_alpha", "model.target_modules", "model.exclude_modules")


def _adapter_settings(t: Translation) -> None:
    if "model.lora_adapter_path" not in t.settings:
        return
    for key in ADAPTER_SETTINGS:
        if key in t.settings and t.sources.get(key) != "verl default":
            t.ignored.append((t.sources.pop(key), "model.lora_adapter_path is set: verl takes the adapter's "
                              "own setting from its adapter_config.json, as rlx does"))
            del t.settings[key]


def _warmup_steps(value: Any, t: Translation, verl: dict[str, Any]) -> None:
    """verl steps its lr schedule once per training step, rlx once per optimizer step: verl's N warm-up
    steps are N x ppo_epochs x (train_batch_size / ppo_mini_batch_size) of rlx's."""
    if isinstance(value, int) and value < 0:
        raise _Ignored("negative: verl then uses lr_warmup_steps_ratio")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Unmapped(f"{value!r} is not a whole number of steps")
    epochs, batch, mini = (verl.get(AA + "ppo_epochs", 1), verl.get("data.train_batch_size", 1024),
                           verl.get(AA + "ppo_mini_batch_size", 256))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (epochs, batch, mini)) \
            or batch % mini:
        raise _Unmapped("rlx counts warm-up in optimizer steps, and the optimizer steps per training step "
                        "(ppo_epochs x train_batch_size / ppo_mini_batch_size) are not whole numbers here")
    per_step = epochs * (batch // mini)
    t.set("actor.optim.warmup_steps", value * per_step, AA + "optim.lr_warmup_steps")
    if value and per_step > 1:
        t.notes.append(f"{AA}optim.lr_warmup_steps={value}: {value * per_step} optimizer steps in rlx "
                       f"({per_step} per training step)")


def _warmup_ratio(value: Any, t: Translation, verl: dict[str, Any], role: str = "actor") -> None:
    if not value:
        raise _Ignored("0: no warm-up")
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise _Unmapped(f"{value!r} is not a fraction between 0 and 1")
    prefix = AA if role == "actor" else "critic."
    steps = verl.get(prefix + "optim.lr_warmup_steps")
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
        raise _Ignored(f"{prefix}optim.lr_warmup_steps={steps} is given and wins, as in verl")
    # rlx's warm-up, like verl's, counts the optimizer's steps: the same fraction of the same count.
    t.set(f"{role}.optim.warmup_ratio", float(value), prefix + "optim.lr_warmup_steps_ratio")


def _schedule(value: Any, t: Translation, source: str) -> None:
    if value not in ("constant", "cosine", "linear"):
        raise _Unmapped("rlx's schedules are constant, cosine and linear")
    t.set("actor.optim.lr_schedule", value, source)


def _val_do_sample(value: Any, t: Translation, verl: dict[str, Any]) -> None:
    if value is False:
        t.set("rollout.val_temperature", 0.0, RO + "val_kwargs.do_sample")
    elif RO + "val_kwargs.temperature" not in verl:
        raise _Unmapped("sampling during validation at verl's default temperature; give val_kwargs.temperature")


def _micro_batch(value: Any, key: str, t: Translation, source: str, note: str) -> None:
    """Log-prob micro-batches: rlx has one size for the actor's and the reference's passes; a micro-batch
    changes memory, not results, so the smaller of verl's sizes is kept."""
    if value is None:
        raise _Ignored("null")
    if key in t.settings and t.settings[key] != value:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (t.settings[key], value)):
            raise _Unmapped(f"{value!r} and {t.settings[key]!r} ({t.sources[key]}): micro-batch sizes are "
                            "whole numbers")
        kept = min(int(t.settings[key]), int(value))
        t.notes.append(f"{note}: verl gives {t.settings[key]} ({t.sources[key]}) and {value} ({source}); rlx has "
                       f"one size and uses the smaller, {kept} (micro-batches change memory, not results)")
        t.set(key, kept, f"{t.sources[key]}, {source}")
        return
    t.set(key, value, source)


def _dynamic_log_prob(value: Any, t: Translation, verl: dict[str, Any], source: str) -> None:
    actor = verl.get(AA + "use_dynamic_bsz", False)
    if bool(value) != bool(actor):
        t.notes.append(f"{source}={value}: rlx's log-prob passes follow actor.use_dynamic_bsz ({actor}); "
                       "this changes memory, not results")
    raise _Ignored("follows actor.use_dynamic_bsz")


def _deprecated_global(value: Any, key: str, verl: dict[str, Any], t: Translation, target: str) -> None:
    """verl's older global micro-batch sizes: split over the GPUs, as verl does, unless the ``*_per_gpu`` key
    is given too (it wins in verl)."""
    if value is None:
        raise _Ignored("null")
    if verl.get(key + "_per_gpu") is not None:
        raise _Ignored(f"{key}_per_gpu is given and wins")
    gpus = _count(verl, "trainer.n_gpus_per_node") * _count(verl, "trainer.nnodes")
    if isinstance(value, bool) or not isinstance(value, int) or value < gpus or value % gpus:
        raise _Unmapped(f"a global micro-batch size of {value!r}, which verl splits over {gpus} GPUs; give the "
                        "*_per_gpu key instead")
    if target == "actor.log_prob_micro_batch_size_per_device":
        _micro_batch(value // gpus, target, t, key, "log-prob micro-batch")
    else:
        t.set(target, value // gpus, key)
    t.notes.append(f"{key}={value}: {value // gpus} per GPU over {gpus} GPUs ({target})")


def _critic_mini_batch(value: Any, verl: dict[str, Any]) -> None:
    actor = verl.get(AA + "ppo_mini_batch_size", value)
    if value != actor:
        raise _Unmapped(f"rlx's critic uses the actor's mini-batch ({actor})")
    raise _Ignored("equal to the actor's, which rlx's critic uses")


def _engine_problems(name: str, pm: Any) -> list[str]:
    """What keeps the rlx engine ``name`` from running here (its options model's own check), or []."""
    try:
        options = pm.get("rollout", name).load_config_model()
        check = getattr(options, "plugin_problems", None) if options is not None else None
        return list(check(options(), pm)) if check is not None else []
    except Exception as exc:
        return [str(exc)]


def _rollout_name(value: Any, t: Translation, pm: Any) -> None:
    available = {n for (k, n) in pm.components() if k == "rollout"} if pm is not None else {"hf"}
    problems = _engine_problems(str(value), pm) if value in available and pm is not None else []
    if value in available and not problems:
        t.set("rollout.name", value, RO + "name")
        return
    why = problems[0].removeprefix("name: ") if problems else "no rlx rollout engine of that name is installed"
    t.notes.append(f"{RO}name={value}: {why}; the run uses 'hf' (the engine changes speed, not the distribution "
                   "sampled from)")
    t.set("rollout.name", "hf", RO + "name")


def _engine_option(key: str, value: Any, t: Translation, pm: Any) -> None:
    engine = t.settings.get("rollout.name", "hf")
    option = ENGINE_OPTIONS[key].get(engine)
    if option is None or value is None or not _core_or_option_key_exists(f"rollout.{option}", t.settings, pm):
        raise _Ignored(f"{_PLACEMENT} (the {engine} engine has no such setting)")
    t.set(f"rollout.{option}", value, key)


def _only_if(value: Any, fine: Any, why: str) -> None:
    if value != fine:
        raise _Unmapped(why)
    raise _Ignored(f"{fine!r} is what rlx does")


def _adv_estimator(value: Any, t: Translation) -> None:
    algorithm, estimator = _algorithm_for(str(value))
    t.set("algorithm.name", algorithm, "algorithm.adv_estimator")
    if estimator is not None:
        t.set("algorithm.adv_estimator", estimator, "algorithm.adv_estimator")
    if value == "gae":
        t.notes.append("algorithm.adv_estimator=gae: rlx's ppo algorithm (GAE with a critic)")


Special = Callable[[Any, Translation, dict[str, Any], Any], None]
SPECIAL: dict[str, Special] = {
    "algorithm.adv_estimator": lambda v, t, verl, pm: _adv_estimator(v, t),
    "trainer.save_freq": lambda v, t, verl, pm: _save_freq(v, t),
    "trainer.logger": lambda v, t, verl, pm: _loggers(v, t),
    "trainer.default_local_dir": lambda v, t, verl, pm: _output_dir(v, t),
    "trainer.resume_mode": lambda v, t, verl, pm: _resume(v, t),
    "trainer.total_training_steps": lambda v, t, verl, pm: _total_steps(v, t),
    "trainer.total_epochs": lambda v, t, verl, pm: t.set("trainer.total_epochs", v, "trainer.total_epochs"),
    MODEL + "lora_rank": lambda v, t, verl, pm: _lora_rank(v, t),
    MODEL + "lora_adapter_path": lambda v, t, verl, pm: _lora_adapter_path(v, t),
    AA + "optim.lr_warmup_steps": lambda v, t, verl, pm: _warmup_steps(v, t, verl),
    AA + "optim.lr_warmup_steps_ratio": lambda v, t, verl, pm: _warmup_ratio(v, t, verl),
    "critic.optim.lr_warmup_steps_ratio": lambda v, t, verl, pm: _warmup_ratio(v, t, verl, "critic"),
    AA + "optim.warmup_style": lambda v, t, verl, pm: _schedule(v, t, AA + "optim.warmup_style"),
    AA + "optim.lr_scheduler_type": lambda v, t, verl, pm: _schedule(v, t, AA + "optim.lr_scheduler_type"),
    RO + "val_kwargs.do_sample": lambda v, t, verl, pm: _val_do_sample(v, t, verl),
    **{key: (lambda k: lambda v, t, verl, pm: _engine_option(k, v, t, pm))(key) for key in ENGINE_OPTIONS},
    RO + "log_prob_micro_batch_size_per_gpu": lambda v, t, verl, pm: _micro_batch(
        v, "actor.log_prob_micro_batch_size_per_device", t, RO + "log_prob_micro_batch_size_per_gpu",
        "log-prob micro-batch"),
    REF + "log_prob_micro_batch_size_per_gpu": lambda v, t, verl, pm: _micro_batch(
        v, "actor.log_prob_micro_batch_size_per_device", t, REF + "log_prob_micro_batch_size_per_gpu",
        "log-prob micro-batch"),
    RO + "log_prob_max_token_len_per_gpu": lambda v, t, verl, pm: _micro_batch(
        v, "actor.log_prob_max_token_len_per_gpu", t, RO + "log_prob_max_token_len_per_gpu", "log-prob token budget"),
    REF + "log_prob_max_token_len_per_gpu": lambda v, t, verl, pm: _micro_batch(
        v, "actor.log_prob_max_token_len_per_gpu", t, REF + "log_prob_max_token_len_per_gpu", "log-prob token budget"),
    RO + "log_prob_use_dynamic_bsz": lambda v, t, verl, pm: _dynamic_log_prob(v, t, verl,
                                                                              RO + "log_prob_use_dynamic_bsz"),
    REF + "log_prob_use_dynamic_bsz": lambda v, t, verl, pm: _dynamic_log_prob(v, t, verl,
                                                                               REF + "log_prob_use_dynamic_bsz"),
    AA + "ppo_micro_batch_size": lambda v, t, verl, pm: _deprecated_global(
        v, AA + "ppo_micro_batch_size", verl, t, "actor.micro_batch_size_per_device"),
    RO + "log_prob_micro_batch_size": lambda v, t, verl, pm: _deprecated_global(
        v, RO + "log_prob_micro_batch_size", verl, t, "actor.log_prob_micro_batch_size_per_device"),
    REF + "log_prob_micro_batch_size": lambda v, t, verl, pm: _deprecated_global(
        v, REF + "log_prob_micro_batch_size", verl, t, "actor.log_prob_micro_batch_size_per_device"),
    "critic.ppo_micro_batch_size": lambda v, t, verl, pm: _deprecated_global(
        v, "critic.ppo_micro_batch_size", verl, t, "critic.micro_batch_size_per_device"),
    "critic.ppo_mini_batch_size": lambda v, t, verl, pm: _critic_mini_batch(v, verl),
    "actor_rollout_ref.hybrid_engine": lambda v, t, verl, pm: _only_if(
        _is_true(v), True, "verl without its hybrid engine (separate actor and rollout workers): rlx colocates them, "
        "or places the engine with launcher.rollout_nproc"),
    "trainer.val_only": lambda v, t, verl, pm: _only_if(bool(v), False, "rlx validates during training only "
                                                                        "(use rlx eval)"),
    "reward_model.reward_manager": lambda v, t, verl, pm: _reward_manager(v),
    **{key: (lambda k: lambda v, t, verl, pm: _dapo_key(k, verl))(key) for key in (
        OVERLONG + "enable", OVERLONG + "len", OVERLONG + "penalty_factor", OVERLONG + "log",
        _DAPO_KWARGS + "max_resp_len")},
    AA + "optim.lr_decay_style": lambda v, t, verl, pm: _schedule(v, t, AA + "optim.lr_decay_style"),
    RO + "checkpoint_engine.update_weights_bucket_megabytes": lambda v, t, verl, pm: _bucket(v, t, pm),
    "trainer.resume_from_path": lambda v, t, verl, pm: _resume_path(v, verl),
    "data.sampler.class_path": lambda v, t, verl, pm: _sampler(t, verl, "data.sampler.class_path"),
    "data.sampler.class_name": lambda v, t, verl, pm: _sampler(t, verl, "data.sampler.class_name"),
    "data.trust_remote_code": lambda v, t, verl, pm: _remote_code(v, t, "data.trust_remote_code"),
    "critic.model.trust_remote_code": lambda v, t, verl, pm: _remote_code(v, t, "critic.model.trust_remote_code"),
    "algorithm.rollout_correction.bypass_mode": lambda v, t, verl, pm: _bypass_mode(v, t, verl),
    "algorithm.use_pf_ppo": lambda v, t, verl, pm: _pf_ppo("algorithm.use_pf_ppo", v, t, verl),
    "algorithm.pf_ppo.reweight_method": lambda v, t, verl, pm: _pf_ppo("algorithm.pf_ppo.reweight_method", v, t,
                                                                       verl),
    "algorithm.pf_ppo.weight_pow": lambda v, t, verl, pm: _pf_ppo("algorithm.pf_ppo.weight_pow", v, t, verl),
}


def _pf_ppo(key: str, value: Any, t: Translation, verl: dict[str, Any]) -> None:
    """PF-PPO keys map one to one, but verl resamples only in its gae branch: with another estimator its
    ``use_pf_ppo`` does nothing, and so is left out."""
    if not _is_true(verl.get("algorithm.use_pf_ppo")):
        raise _Ignored("algorithm.use_pf_ppo is not true")
    estimator = verl.get("algorithm.adv_estimator", "gae")
    if estimator != "gae":
        raise _Ignored(f"verl applies PF-PPO with adv_estimator=gae only, not {estimator}")
    if value is None:
        raise _Ignored(f"null: rlx's default for {key} applies")
    t.set(key, value, key)


OVERRIDE_CONFIG = MODEL + "override_config"


def _override_config(key: str, value: Any, t: Translation) -> None:
    """verl's ``model.override_config.ATTR`` sets ATTR on the model's Hugging Face config, as rlx's
    ``model.override_config.ATTR``; the megatron workers read the same attributes under ``model_config.`` (verl's
    engine workers take either form). ``attn_implementation`` there picks verl's attention kernel."""
    name = key[len(OVERRIDE_CONFIG):].lstrip(".")
    if not name:
        if value in (None, {}):
            raise _Ignored("empty: the model's config as it is")
        raise _Unmapped(f"{value!r} is not a mapping of config attributes")
    if name.startswith("model_config."):
        name = name[len("model_config."):]
    if name == "attn_implementation":
        raise _Ignored("the attention kernel (rlx: backend.attn_implementation): " + _PLACEMENT)
    t.set(f"model.override_config.{name}", value, key)


TEMPLATE_KWARGS = "data.apply_chat_template_kwargs"


def _template_kwargs(key: str, value: Any, t: Translation) -> None:
    """verl's ``data.apply_chat_template_kwargs.NAME``: a further argument of the chat template (its dataset's and
    its agent loops' renderings), rlx's ``data.apply_chat_template_kwargs.NAME``."""
    name = key[len(TEMPLATE_KWARGS):].lstrip(".")
    if not name:
        if value in (None, {}):
            raise _Ignored("empty: the chat template's own defaults")
        raise _Unmapped(f"{value!r} is not a mapping of template arguments")
    if "." in name:
        raise _Unmapped(f"{name!r} is not one argument name")
    t.set(f"{TEMPLATE_KWARGS}.{name}", value, key)


def _bypass_mode(value: Any, t: Translation, verl: dict[str, Any]) -> None:
    if not isinstance(value, bool):
        raise _Unmapped(f"{value!r} is not true or false")
    t.set("algorithm.rollout_correction.bypass_mode", value, "algorithm.rollout_correction.bypass_mode")


def _bypass_loss(t: Translation) -> None:
    """verl's bypass mode replaces the actor's loss_mode by its own; rlx's config says so (a third loss beside bypass
    mode is a config error there)."""
    mode = t.settings.get("algorithm.policy_loss", "vanilla")
    if t.settings.get("algorithm.rollout_correction.bypass_mode") is True and mode not in ("vanilla", "bypass_mode"):
        t.set("algorithm.policy_loss", "bypass_mode", "algorithm.rollout_correction.bypass_mode")
        t.notes.append(f"algorithm.rollout_correction.bypass_mode=true: verl replaces the actor's loss_mode={mode} "
                       "by its bypass-mode loss (PPO clip or REINFORCE: rollout_correction.loss_type), and so does "
                       "algorithm.policy_loss=bypass_mode here")


# verl's Megatron settings of the actor -> rlx's megatron backend options (verl lays the reference and
# the critic out on their own; rlx lays every role out as the actor, which changes placement, not results).
MEGATRON = AA + "megatron."
MEGATRON_OPTIONS: dict[str, str] = {
    "tensor_model_parallel_size": "tensor_model_parallel_size",
    "pipeline_model_parallel_size": "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size": "virtual_pipeline_model_parallel_size",
    "context_parallel_size": "context_parallel_size",
    "sequence_parallel": "sequence_parallel",
    "use_distributed_optimizer": "use_distributed_optimizer",
    "override_transformer_config.recompute_granularity": "recompute_granularity",
    "override_transformer_config.recompute_method": "recompute_method",
    "override_transformer_config.recompute_num_layers": "recompute_num_layers",
}
_MEGATRON_PLACEMENT = (
    "param_offload", "grad_offload", "optimizer_offload", "use_mbridge", "vanilla_mbridge", "seed",
    "use_dist_checkpointing", "dist_checkpointing_path", "override_transformer_config.gradient_accumulation_fusion",
    "override_transformer_config.apply_rope_fusion", "override_transformer_config.bias_activation_fusion",
    "override_transformer_config.masked_softmax_fusion", "override_transformer_config.bias_dropout_fusion",
    "override_transformer_config.persist_layer_norm", "override_transformer_config.deallocate_pipeline_outputs",
    "override_transformer_config.attention_backend", "override_transformer_config.num_layers_in_first_pipeline_stage",
    "override_transformer_config.num_layers_in_last_pipeline_stage",
    "override_transformer_config.account_for_loss_in_pipeline_split",
    "override_transformer_config.account_for_embedding_in_pipeline_split")


# megatron-core MoE settings (override_transformer_config.moe_*) that change how the experts are laid out,
# fused or communicated, not which experts a token goes to or what they compute.
MOE_PLACEMENT = ("moe_permute_fusion", "moe_enable_deepep", "moe_token_dispatcher_type", "moe_grouped_gemm",
                 "moe_shared_expert_overlap", "moe_deepep_num_sms", "moe_layer_recompute",
                 "moe_use_legacy_grouped_gemm", "moe_router_fusion")
_EXPERT_SIZES = ("expert_model_parallel_size", "expert_tensor_parallel_size")
# Model folders whose Hugging Face router computes its logits in float32 (DeepseekV3TopkRouter casts the hidden
# states and its weight to float32): DeepSeek-V3/R1 and the models built on its architecture (Moonlight, Kimi-K2).
_FP32_ROUTER_MODEL = re.compile(r"(?i)deepseek[-_]?(?:v3|r1)|moonlight|kimi[-_]?k2")
_FP32_ROUTER_TYPES = ("deepseek_v3", "kimi_k2")
_ON_FSDP2 = ("rlx's megatron backend trains dense language models without LoRA, so this run trains on rlx's fsdp2 "
             "backend: the same Hugging Face model (its experts and router, its vision tower, or its LoRA adapters) "
             "and the same loss; "
             "verl's tensor, pipeline, context and expert parallel sizes only place the computation, and FSDP "
             "shards every weight, the experts included, over the ranks instead")


def _megatron_needs(verl: dict[str, Any]) -> list[str]:
    """What a megatron-strategy run needs that rlx's megatron backend lacks: mixture-of-experts settings (expert
    parallelism, megatron-core's moe_* settings, unless the model is known to be dense) or LoRA (``model.lora.rank``
    above 0)."""
    needs: list[str] = []
    dense = _dense_model(verl) is not None
    for key, value in verl.items():
        rest = key.removeprefix(MEGATRON)
        if rest != key and ((rest in _EXPERT_SIZES and value not in (1, None))
                            or (rest.startswith("override_transformer_config.moe_") and not dense)):
            needs.append(key)
    rank = verl.get(MODEL + "lora.rank")
    if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0:
        needs.append(MODEL + "lora.rank")
    if _vision_supported(str(verl.get(MODEL + "path", ""))):
        needs.append(f"the vision-language model {verl.get(MODEL + 'path')}")
    return needs


def _fp32_router(verl: dict[str, Any]) -> bool:
    """Whether the policy's Hugging Face router computes in float32 anyway (its folder's config.json when the
    folder is on this machine, else the model's name)."""
    path = str(verl.get(MODEL + "path", ""))
    config = Path(os.path.expanduser(path)) / "config.json"
    if config.is_file():
        try:
            model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        return model_type in _FP32_ROUTER_TYPES
    return bool(_FP32_ROUTER_MODEL.search(path.rstrip("/").rpartition("/")[2]))


# Names of mixture-of-experts models: an active-parameter tag (Qwen3-30B-A3B, Qwen3-235B-A22B, ERNIE-4.5-21B-A3B,
# Granite-3.0-3B-A800M), an expert count (Mixtral-8x7B, Llama-4-Scout-17B-16E), "moe" (Qwen1.5-MoE, OLMoE) or a
# family that is MoE throughout.
_MOE_MODEL = re.compile(r"(?i)(?:^|[-_.])a\d+(?:\.\d+)?[bm](?:[-_.]|$)|moe|mixtral|\d+x\d+b|[-_]\d+e(?:[-_.]|$)"
                        r"|gpt-oss|dbrx|jamba|qwen3-next|deepseek[-_]?v2|glm-4\.[56]|minimax|kimi")
# The Hugging Face config attributes that count a model's routed experts (also read by rlx.plugins.modeling.moe).
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _dense_model(verl: dict[str, Any]) -> str | None:
    """Why the policy is known to be a dense model (no experts, so no router), or None when it may have experts:
    its folder's config.json (and its text_config) when the folder is here, else its name (MoE names carry an
    active-parameter tag, an expert count or "moe"); an empty or unexpanded path is not known."""
    path = str(verl.get(MODEL + "path", ""))
    config = Path(os.path.expanduser(path)) / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        parts = [data] + ([data["text_config"]] if isinstance(data.get("text_config"), dict) else [])
        if any(part.get(k) for part in parts for k in _EXPERT_KEYS):
            return None
        return f"its config.json names no experts ({', '.join(_EXPERT_KEYS)})"
    name = path.rstrip("/").rpartition("/")[2]
    if not name or "$" in name or _MOE_MODEL.search(name) or _FP32_ROUTER_MODEL.search(name):
        return None
    return f"{name} is a dense model by its name (no active-parameter tag such as A3B, no expert count, no moe)"


def _moe_setting(name: str, value: Any, verl: dict[str, Any], t: Translation, key: str) -> None:
    """megatron-core's ``override_transformer_config.moe_*`` settings, on rlx's fsdp2 backend (the Hugging Face
    model's own MoE layers): placement is ignored; a float32 router is model.router_dtype=float32; another setting
    of the math is accepted only where it equals what the Hugging Face model computes, and named otherwise.
    Returns when the setting is mapped, else raises :class:`_Ignored` or :class:`_Unmapped`."""
    otc = MEGATRON + "override_transformer_config."
    dense = _dense_model(verl)
    if dense is not None:
        raise _Ignored(f"{value}: no experts: {dense}, so the model has no router or experts for megatron-core's "
                       "MoE settings")
    if name in MOE_PLACEMENT:
        raise _Ignored("how megatron-core lays out, fuses or sends the experts' work (the Hugging Face model computes "
                       "the same experts for each token in its own kernels): " + _PLACEMENT)
    if name == "moe_router_dtype":
        if value is None:
            raise _Ignored("null: the router in the model's dtype")
        if str(value).removeprefix("torch.") not in ("fp32", "float32"):
            raise _Unmapped(f"a router computed in {value}: megatron-core casts the router's input and weight to it; "
                            "rlx's model.router_dtype is auto (the model's dtype) or float32")
        if _fp32_router(verl):
            raise _Ignored(f"{value}: this model's Hugging Face router (DeepSeek-V3's) computes its logits in "
                           "float32 too")
        # NOTE: Qwen-MoE's, Mixtral's and Qwen3-VL-MoE's Hugging Face routers compute in model.dtype; rlx's
        # float32 router casts the gate's input and weight as megatron-core does (the experts unchanged).
        t.set("model.router_dtype", "float32", key)
        return
    if name == "moe_router_load_balancing_type":
        if value in ("none", None):
            raise _Ignored("none: no load-balancing loss, as verl's model bridges set it and as rlx computes")
        raise _Unmapped(f"megatron-core's {value} load-balancing loss on the router; rlx's loss has no router term")
    if name == "moe_aux_loss_coeff":
        balancing = verl.get(otc + "moe_router_load_balancing_type", "none")
        if not value or balancing in ("none", None):
            raise _Ignored("verl's model bridges (mbridge since 0.1.0 for Qwen2/Qwen3-MoE, DeepSeek-V3 and "
                           "Qwen3-VL-MoE; Megatron-Bridge, where verl sets it) use "
                           "moe_router_load_balancing_type=none, so megatron-core computes no load-balancing loss "
                           "and never reads the coefficient; rlx computes none either")
        raise _Unmapped("a load-balancing loss on the router (reported with moe_router_load_balancing_type)")
    if name == "moe_z_loss_coeff":
        if not value:
            raise _Ignored("no router z-loss, megatron-core's default")
        raise _Unmapped(f"megatron-core's router z-loss ({value} x the mean squared logsumexp of the router's "
                        "logits); rlx's loss has no router term")
    if name == "moe_expert_capacity_factor":
        if value is None:
            raise _Ignored("null: no token dropping, megatron-core's default and what the Hugging Face model does")
        raise _Unmapped(f"expert capacity {value} (megatron-core drops the tokens beyond it); the Hugging Face model "
                        "sends every token to its experts")
    if name in ("moe_token_drop_policy", "moe_pad_expert_input_to_capacity"):
        if verl.get(otc + "moe_expert_capacity_factor") is None:
            raise _Ignored("read only with moe_expert_capacity_factor, which is not set: no token dropping")
        raise _Unmapped("token dropping (with moe_expert_capacity_factor)")
    raise _Unmapped("a megatron-core MoE setting of the model's shape or routing; rlx's fsdp2 backend builds the "
                    "Hugging Face model from its folder's config")


def _backend(verl: dict[str, Any], t: Translation) -> None:
    """verl's strategy -> rlx's backend: megatron is megatron; fsdp and fsdp2 train the same model as rlx's
    default torch backend, and need rlx's fsdp2 for Ulysses sequence parallelism. A megatron run that needs what
    rlx's megatron backend lacks (mixture-of-experts settings, LoRA) trains the same model on rlx's fsdp2."""
    strategy = verl.get(AA + "strategy", "fsdp")
    needs = _megatron_needs(verl) if strategy == "megatron" else []
    if strategy == "megatron" and needs:
        # NOTE: the megatron backend trains dense models only and has no LoRA; fsdp2 loads any Hugging Face
        # causal LM (mixture-of-experts ones too) and has LoRA. Parallel sizes are placement: the loss, the
        # experts each token is routed to and the gradients are the Hugging Face model's either way.
        t.set("backend.name", "fsdp2", AA + "strategy")
        shown = ", ".join(k.removeprefix(AA).removeprefix(MODEL) for k in needs[:3])
        t.notes.append(f"{AA}strategy=megatron with {shown}{' ...' if len(needs) > 3 else ''}: {_ON_FSDP2}")
    elif strategy == "megatron":
        t.set("backend.name", "megatron", AA + "strategy")
    elif strategy not in ("fsdp", "fsdp2"):
        t.unmapped.append((AA + "strategy", f"rlx's backends are torch, fsdp, fsdp2 and megatron, not {strategy}"))
    elif any(isinstance(verl.get(k), int) and verl.get(k, 1) > 1 for k in (
            AA + "ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size")):
        t.set("backend.name", "fsdp2", AA + "strategy")  # fsdp2 also has LoRA, which FSDP1 cannot hold
        t.notes.append(f"{AA}ulysses_sequence_parallel_size > 1: rlx's fsdp2 backend, which has Ulysses")
    elif isinstance(t.settings.get("launcher.nproc"), int) and t.settings["launcher.nproc"] > 1:
        # NOTE: verl's fsdp strategies shard the weights, gradients and optimizer states over the GPUs; rlx's
        # default torch backend would hold a whole copy on each. fsdp2 is the same math, sharded as verl's.
        t.set("backend.name", "fsdp2", AA + "strategy")
        t.notes.append(f"{AA}strategy={strategy} over {t.settings['launcher.nproc']} GPUs: rlx's fsdp2 backend, "
                       "which shards the model over them as verl's FSDP does (the torch backend would replicate it)")
    for key, value in verl.items():
        rest = key.removeprefix(MEGATRON)
        if rest == key:
            continue
        if strategy != "megatron":
            t.ignored.append((key, f"the actor's strategy is {strategy}: verl reads megatron.* only with megatron"))
        elif needs:
            _megatron_on_fsdp2(key, rest, value, verl, t)
        elif rest == "context_parallel_size" and isinstance(value, int) and not isinstance(value, bool) \
                and value > 1:
            t.ignored.append((key, f"{value}: rlx's megatron backend keeps each sequence on one rank (context "
                              "parallelism 1), the same computation with more memory per rank: " + _PLACEMENT))
        elif rest in MEGATRON_OPTIONS:
            if value is not None:
                t.set(f"backend.{MEGATRON_OPTIONS[rest]}", value, key)
        elif rest in _MEGATRON_PLACEMENT:
            t.ignored.append((key, _PLACEMENT))
        elif rest in _EXPERT_SIZES and value in (1, None):
            t.ignored.append((key, "1: no expert parallelism"))
        elif rest.startswith("override_transformer_config.moe_"):  # a dense model (_megatron_needs)
            t.ignored.append((key, f"{value}: no experts: {_dense_model(verl)}, so the model has no router or experts "
                              "for megatron-core's MoE settings"))
        else:
            t.unmapped.append((key, "no rlx counterpart"))


def _megatron_on_fsdp2(key: str, rest: str, value: Any, verl: dict[str, Any], t: Translation) -> None:
    """An actor ``megatron.*`` key of a run that trains on rlx's fsdp2 backend (:func:`_backend`)."""
    try:
        if rest in _EXPERT_SIZES:
            raise _Ignored("expert parallelism: megatron splits the experts between ranks, FSDP shards every "
                           "expert's weights over all ranks instead; each token goes to the same experts: "
                           + _PLACEMENT)
        if rest in MEGATRON_OPTIONS or rest in _MEGATRON_PLACEMENT:
            if rest == "override_transformer_config.recompute_granularity" and value in ("full", "selective") \
                    and verl.get(MODEL + "enable_gradient_checkpointing") is None:
                t.set("model.gradient_checkpointing", True, key)
                raise _Ignored(f"{value} recomputation: model.gradient_checkpointing=true recomputes the activations "
                               "in rlx (memory, not results)")
            raise _Ignored("megatron's parallel layout, recomputation or offloading; rlx's fsdp2 backend shards the "
                           "same model over the ranks: " + _PLACEMENT)
        name = rest.removeprefix("override_transformer_config.")
        if name.startswith("moe_"):
            _moe_setting(name, value, verl, t, key)
            return
        raise _Unmapped("a megatron setting with no counterpart in rlx's fsdp2 backend")
    except _Ignored as exc:
        t.ignored.append((key, str(exc)))
    except _Unmapped as exc:
        t.unmapped.append((key, str(exc)))


# verl's megatron LoRA (Megatron-Bridge's PEFT, actor_rollout_ref.model.lora.*): canonical LoRA's module names ->
# the Hugging Face names of the same linear layers, where peft puts rlx's adapters.
CANONICAL_LORA = {"linear_q": "q_proj", "linear_k": "k_proj", "linear_v": "v_proj", "linear_proj": "o_proj",
                  "linear_fc1_gate": "gate_proj", "linear_fc1_up": "up_proj", "linear_fc2": "down_proj"}
FUSED_LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]  # verl's default target_modules
MLORA = MODEL + "lora."


def _megatron_lora(name: str, value: Any, t: Translation, verl: dict[str, Any]) -> None:
    """One ``model.lora.*`` key (verl's LoRA for the megatron strategy, which :func:`_backend` moves onto rlx's
    fsdp2 backend, whose LoRA is peft's)."""
    rank = verl.get(MLORA + "rank", 0)
    if name == "rank":
        if not rank:
            raise _Ignored("0: no LoRA, the whole model trains")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise _Unmapped(f"{rank!r} is not a whole number")
        kind = verl.get(MLORA + "type", "lora")
        if kind == "lora":
            raise _Unmapped("verl's lora type (Megatron-Bridge's fused LoRA, verl's default) gives the fused q/k/v "
                            "projection (linear_qkv) one adapter whose A is shared by q, k and v, and the fused "
                            "gate/up projection (linear_fc1) one adapter; rlx's LoRA (peft) gives each of q_proj, "
                            "k_proj, v_proj, gate_proj and up_proj its own: another set of trainable updates. "
                            "model.lora.type=canonical_lora is what rlx computes")
        if kind != "canonical_lora":
            raise _Unmapped(f"verl's {kind} adapters; rlx's LoRA is plain LoRA (canonical_lora's)")
        targets = verl.get(MLORA + "target_modules", list(CANONICAL_LORA))
        names = [targets] if isinstance(targets, str) else list(targets or [])
        unknown = [n for n in names if n not in CANONICAL_LORA]
        if unknown:
            raise _Unmapped(f"canonical LoRA on {', '.join(map(str, unknown))}: rlx maps linear_q/k/v, linear_proj, "
                            "linear_fc1_gate/up and linear_fc2 onto the Hugging Face layers")
        if any(k != MLORA + "rank" for k in _megatron_needs(verl)):
            raise _Unmapped("LoRA on a mixture-of-experts model: Megatron-Bridge puts adapters on every expert's "
                            "linear_fc1/linear_fc2; peft adapts the model's nn.Linear layers, and a Hugging Face "
                            "MoE's experts are 3-D parameters it does not adapt")
        t.set("model.lora_rank", rank, MLORA + "rank")
        t.set("model.target_modules", [CANONICAL_LORA[n] for n in names], MLORA + "target_modules")
        for key, default, why in (
                ("lora_A_init_method", "xavier", "peft initialises A as Megatron-Bridge's kaiming does "
                 "(kaiming_uniform with a = sqrt(5)); verl's default, xavier, draws A from xavier_normal, which rlx "
                 "does not offer"),
                ("lora_B_init_method", "zero", "peft starts B at zero, as Megatron-Bridge's zero does")):
            given = verl.get(MLORA + key, default)
            if given != ("kaiming" if key == "lora_A_init_method" else "zero"):
                t.unmapped.append((MLORA + key, f"{given}{' (verl default)' if MLORA + key not in verl else ''}: "
                                   f"{why}"))
        return
    if not rank:
        raise _Ignored("model.lora.rank is 0: no LoRA")
    if name in ("type", "target_modules"):
        return  # read with the rank
    if name == "alpha":
        t.set("model.lora_alpha", value, MLORA + "alpha")  # both scale the update by alpha / rank
    elif name == "dropout":
        if value:
            t.set("model.lora_dropout", value, MLORA + "dropout")
        else:
            raise _Ignored("0: no dropout")
    elif name == "dropout_position":
        if value != "pre" and verl.get(MLORA + "dropout"):
            raise _Unmapped(f"dropout {value} the adapter; peft's dropout is on the adapter's input (pre)")
        raise _Ignored(f"{value}: peft's dropout is on the adapter's input (pre)")
    elif name in ("lora_A_init_method", "lora_B_init_method"):
        wanted = "kaiming" if name == "lora_A_init_method" else "zero"
        if value == wanted:
            raise _Ignored("peft's own initialisation of this matrix (kaiming_uniform with a = sqrt(5) for A, "
                           "zero for B), as Megatron-Bridge's")
        # an unequal one is named with the rank
    elif name in ("merge", "a2a_experimental"):
        raise _Ignored("how the adapters reach the engine (merged or not) or travel between ranks: " + _PLACEMENT)
    elif name in ("freeze_vision_model", "freeze_vision_projection", "freeze_language_model"):
        raise _Ignored("read by verl's vlm_lora only")
    elif name in ("dtype", "adapter_path") or name == "exclude_modules":
        if value in (None, [], ""):
            raise _Ignored("null: the default")
        raise _Unmapped("the adapters' own dtype, a saved adapter or excluded megatron modules; rlx's LoRA starts "
                        "new adapters in the trained dtype on the modules model.target_modules names")
    else:
        raise _Unmapped("no rlx counterpart")


def _reward_manager(value: Any) -> None:
    if value in ("naive", "batch"):
        raise _Ignored("rlx scores each response on its own, as verl's naive manager (batch: the same scores, "
                       "computed together)")
    if value != "dapo":
        raise _Unmapped(f"verl's {value} reward manager; rlx follows naive, batch and dapo")
    raise _Ignored("the dapo manager's rule score is the router reward; its overlong buffer, when enabled, is "
                   "rlx's overlong reward in a mix")


def _verl_key_meant(key: str) -> str:
    """``; did you mean data.train_files?`` when ``key`` is a near miss of a verl key this translation knows
    (verl's Hydra refuses a misspelt key too), else ``""``: the same section with a close last name, or the
    same last name in a section misspelt. None of the 714 keys of verl's generated trainer configs that this
    translation does not know gets a suggestion."""
    import difflib

    known = sorted({k for k in (*DIRECT, *SPECIAL, *IGNORED, *MISSING, *VISION_KEYS) if not k.endswith(".")})
    parent, _, name = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.88)
    if close:
        return f"; did you mean {siblings[close[0]]}?"
    # A misspelt section: one part of the key differs, and only by a letter or two (actr for actor; verl's
    # actor.strategy is no misspelling of ref.strategy, nor lora.rank of lora_rank).
    parts = key.split(".")
    for other in known:
        theirs = other.split(".")
        if len(theirs) != len(parts) or parts[-1] != theirs[-1]:
            continue
        differ = [(a, b) for a, b in zip(parts, theirs, strict=True) if a != b]
        if len(differ) == 1 and difflib.SequenceMatcher(None, *differ[0]).ratio() >= 0.8:
            return f"; did you mean {other}?"
    return ""


def _is_ignored(key: str) -> str | None:
    for pattern, why in IGNORED.items():
        if key == pattern or (pattern.endswith(".") and key.startswith(pattern)):
            return why
    return None


def _reward(verl: dict[str, Any], t: Translation) -> None:
    """verl's reward: the reward model's scores when enabled, else the custom function, else its rule
    rewards chosen by each row's data_source (rlx's router)."""
    if verl.get("reward_model.enable"):
        t.set("reward.name", "reward_model", "reward_model.enable")
        for key in [k for k in verl if k.startswith("custom_reward_function.")]:
            t.unmapped.append((key, "verl uses the reward model's scores alone when reward_model.enable=True; "
                                    "to combine both, use rlx's mix reward"))
        return
    if verl.get("custom_reward_function.path"):
        t.set("reward.name", "custom", "custom_reward_function.path")
        return
    t.set("reward.name", "router", "verl default")
    t.notes.append("no reward model or custom function: verl scores by each row's data_source, as rlx's router "
                   "reward does")
    if verl.get("reward_model.reward_manager") == "dapo" and verl.get(OVERLONG + "enable") in (True, "True", "true"):
        # DAPO's soft overlong punishment: 0 up to max_resp_len - len tokens, then down to -penalty_factor at
        # max_resp_len, added to the rule reward; rlx's overlong reward is that term, mixed in.
        options = {"buffer_tokens": verl.get(OVERLONG + "len"), "penalty": verl.get(OVERLONG + "penalty_factor")}
        if verl.get(_DAPO_KWARGS + "max_resp_len") is not None:
            options["max_tokens"] = verl[_DAPO_KWARGS + "max_resp_len"]
        t.set("reward.name", "mix", "reward_model.reward_manager")
        t.set("reward.components", [{"name": "router"}, {"name": "overlong", "options": {
            k: v for k, v in options.items() if v is not None}}], OVERLONG + "*")
        t.notes.append("reward_model.reward_manager=dapo with overlong_buffer_cfg.enable: rlx's mix of the "
                       "router (the rule reward) and the overlong penalty")


RM_ROLLOUT = "reward_model.rollout."


def _reward_loop(verl: dict[str, Any]) -> bool:
    """Whether verl serves the reward model from an inference engine (its reward loop, the default)."""
    return bool(verl.get("reward_model.enable")) and verl.get("reward_model.use_reward_loop", True) not in (
        False, "False", "false")


def _reward_engine(key: str, verl: dict[str, Any]) -> None:
    """``reward_model.rollout.*``: the inference engine verl's reward loop serves the reward model from. With
    no custom reward function (refused with the reward model, by :func:`_reward`) verl asks that engine to
    classify each conversation and takes the raw score, as rlx's reward_model computes it in its worker."""
    if not verl.get("reward_model.enable"):
        raise _Ignored("reward_model.enable is not true")
    if not _reward_loop(verl):
        raise _Ignored("reward_model.use_reward_loop is false: verl's reward-model worker does not read it")
    if key in (RM_ROLLOUT + "prompt_length", RM_ROLLOUT + "response_length"):
        raise _Ignored("the engine's generation lengths: a classifying reward model generates nothing (how much "
                       "of a conversation it reads: the note on reward.max_length)")
    raise _Ignored("the inference engine verl serves the sequence-classification reward model from (its memory, "
                   "parallelism, caches): rlx's reward_model scores the same conversations with the same model in "
                   "its reward worker; " + _PLACEMENT)


def _reward_context(verl: dict[str, Any], t: Translation) -> None:
    """How much of a conversation the reward model reads. verl's reward loop scores each conversation whole (up
    to the reward model's own context); its older reward-model worker cuts the end beyond reward_model.max_length,
    by default the batch's prompt + response width. rlx's reward model keeps the last ``reward.max_length``
    tokens: made at least as long as the prompt and response."""
    if t.settings.get("reward.name") != "reward_model" or "reward.max_length" in t.settings:
        return
    lengths = [verl.get("data.max_prompt_length", 512), verl.get("data.max_response_length", 512),
               verl.get(RM_ROLLOUT + "prompt_length"), verl.get(RM_ROLLOUT + "response_length")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in lengths[:2]):
        return
    total = lengths[0] + lengths[1]
    if not _reward_loop(verl):
        t.set("reward.max_length", total, "data.max_prompt_length + data.max_response_length")
        t.notes.append(f"reward.max_length={total}: verl's reward-model worker reads at most the prompt and response "
                       "width, in the reward model's tokens, and cuts a longer conversation's end; rlx cuts its start")
        return
    rm = lengths[2] + lengths[3] if all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                        for v in lengths[2:]) else 0
    t.set("reward.max_length", max(total, rm), "data.max_prompt_length + data.max_response_length"
          if total >= rm else RM_ROLLOUT + "prompt_length + response_length")
    t.notes.append(f"reward.max_length={max(total, rm)}: verl's reward loop scores each conversation whole, rlx's "
                   "reward model keeps its last reward.max_length tokens; a conversation the reward model's "
                   "template and tokenizer make longer than that loses its start in rlx")


# verl keys whose feature rlx does not have (key, or prefix ending in "."), each with the feature named.
MISSING: dict[str, str] = {
    "data.custom_cls.": "a dataset class of verl's (Python code), which rlx never imports from a verl config; "
    "rlx reads verl-shaped parquet rows itself",
    MODEL + "custom_chat_template": "a chat template other than the tokenizer's own, which rlx formats prompts with",
    MODEL + "torch_dtype": "not a key of verl's model config (verl's Hydra refuses it unless written with a "
    "leading +; the model's dtype is fsdp_config.model_dtype there, model.dtype in rlx)",
    MODEL + "mtp.": "multi-token prediction (MTP) layers trained beside the policy",
    "algorithm.use_pf_ppo": "verl's PF-PPO (the batch reweighted or resampled by reward)",
    "algorithm.pf_ppo.": "verl's PF-PPO (the batch reweighted or resampled by reward)",
    "reward_model.sandbox_fusion.": "an external Sandbox Fusion service that runs responses' code to score them",
    AA + "calculate_sum_pi_squared": "the sum of squared probabilities over the vocabulary for verl's "
    "optimal-token-baseline estimator, which no rlx backend computes",
    AA + "router_replay.": "mixture-of-experts routing replay (the rollout's expert choices replayed in training)",
    RO + "enable_rollout_routing_replay": "mixture-of-experts routing replay (the rollout's expert choices "
    "replayed in training)",
}

VISION = ("vision inputs of a kind rlx lacks: rlx feeds a row's images (data.image_key, no videos) to the "
          "vision-language models of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and GLM-4.1V")
VISION_KEYS = ("data.image_key", "data.video_key", "data.return_multi_modal_inputs", AA + "freeze_vision_tower",
               "data.image_patch_size")
# Model folders of vision-language models (Qwen2.5-VL, Qwen3-VL, GLM-4.1V, MiniCPM-o/V, LLaVA, InternVL) and
# verl's geo3k data (its prompts hold images): verl reads the images column (data.image_key, default images)
# without being told.
_VISION_MODEL = re.compile(r"(?i)(?:[-_]vl(?:[-_]|$)|\d(?:\.\d+)?v[-_]|llava|internvl|minicpm-?[ov](?:[-_]|$))")
# The ones rlx feeds images to (rlx.run.vision), by name when the folder is not on this machine.
_VISION_SUPPORTED = re.compile(r"(?i)(?:qwen2(?:\.5)?-vl|qwen3-vl|glm-4\.1v)")


def _vision_supported(path: str) -> bool | None:
    """Whether rlx feeds images to the model at ``path`` (its config.json's model type when the folder is here,
    else its name); None when the model is no vision-language model at all."""
    from rlx.run.vision import FAMILIES

    config = Path(os.path.expanduser(path)) / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict):
            if "vision_config" not in data:
                return None
            return data.get("model_type") in FAMILIES
    name = path.rstrip("/").rpartition("/")[2]
    if not _VISION_MODEL.search(name) and not _VISION_SUPPORTED.search(name):
        return None
    return bool(_VISION_SUPPORTED.search(name))


def _vision(verl: dict[str, Any], t: Translation) -> None:
    """A vision-language model or verl's image data: rlx's own image inputs (rlx.run.vision), or the sentence of
    what it lacks."""
    model = str(verl.get(MODEL + "path", ""))
    supported = _vision_supported(model)
    if supported is False:
        t.unmapped.append(("data.image_key", f"{VISION}, and {model} is not one of them"))
    elif supported is None and "geo3k" in " ".join(str(verl.get(k, "")) for k in ("data.train_files",
                                                                                   "data.val_files")).lower():
        t.unmapped.append(("data.image_key", f"{VISION}: verl's geo3k data holds images, and the model {model} "
                                             "is not a vision-language model"))


def _vision_key(key: str, value: Any, t: Translation) -> None:
    """The data and actor settings of image inputs."""
    if key == "data.image_key":
        if value is None:
            raise _Ignored("null: rlx's default data.image_key=images")
        t.set("data.image_key", value, key)
    elif key == "data.video_key":
        if value in (None, ""):
            raise _Ignored("null: no videos")
        raise _Unmapped("videos in the prompts: rlx's vision inputs are images")
    elif key == "data.return_multi_modal_inputs":
        if value is True:
            raise _Ignored("true (verl's default): rlx's batches always carry the images' tensors to the actor's "
                           "forward passes")
        raise _Unmapped("false: verl then leaves the image tensors to its agent loop, which rlx's text-only agent "
                        "loops cannot take")
    elif key == AA + "freeze_vision_tower":
        if value not in (True, False):
            raise _Unmapped(f"{value!r}: verl takes true or false")
        t.set("actor.freeze_vision_tower", value, key)
    elif key == "data.image_patch_size":
        raise _Ignored("verl resizes images to a multiple of this patch size (times the merge size) before its "
                       "processor does; rlx resizes with the model's own image processor, whose patch size this is")


def _dapo_key(key: str, verl: dict[str, Any]) -> None:
    """The DAPO reward manager's settings, read by :func:`_reward`."""
    if verl.get("reward_model.reward_manager") != "dapo":
        raise _Unmapped("a setting of verl's dapo reward manager, without reward_model.reward_manager=dapo")
    if key == OVERLONG + "log":
        raise _Ignored("logging only")


# ---------------------------------------------------------------------------------------------
# Multi-turn rollouts with tool calls (verl's agent loop) -> rlx's agent section
MT = RO + "multi_turn."
AGENT = RO + "agent."
_DOCS_AGENTS = "docs/agents.md"
# verl's agent-loop registry names (verl/experimental/agent_loop) -> rlx's agent loops.
AGENT_LOOPS: dict[str, str] = {"single_turn_agent": "single_turn", "tool_agent": "tool_call"}
# verl's tool-call parsers (multi_turn.format) -> rlx's tool_call formats.
TOOL_FORMATS: dict[str, str] = {"hermes": "hermes", "llama3_json": "llama3"}
# verl's truncate sides name the part that is kept (left: the start, right: the end); rlx's the side cut away.
TRUNCATE_SIDES: dict[str, str] = {"left": "left", "right": "right", "middle": "middle"}  # both name the part kept
SANDBOX_FUSION = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
# verl's tool classes rlx has no tool for -> the missing feature, in one sentence.
GSM8K_TOOL = "verl.tools.gsm8k_tool.Gsm8kTool"
GSM8K_INTERACTION = "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
REFUSED_TOOLS: dict[str, str] = {
    "verl.tools.geo3k_tool.Geo3kTool": "verl's geo3k tool scores each answer the model submits against the row's "
    "ground truth and tells the model its score; geo3k's prompts hold images, and rlx's agent loops are text only",
    "verl.tools.image_zoom_in_tool.ImageZoomInTool": "verl's image zoom-in tool returns images, and rlx's agent loops "
    "are text only",
    "verl.tools.search_tool.SearchTool": "verl's search tool queries a retrieval service; rlx has no search tool",
    "verl.tools.mcp_search_tool.MCPSearchTool": "verl's MCP search tool calls tools of an MCP server; rlx has no MCP "
    "client",
    "verl.tools.mcp_base_tool.MCPBaseTool": "verl's MCP tool calls tools of an MCP server; rlx has no MCP client",
}
# multi_turn.* and agent.* keys that change nothing rlx computes.
AGENT_IGNORED: dict[str, str] = {
    MT + "enable": "",  # read by _agent
    MT + "_target_": "verl's dataclass target", AGENT + "_target_": "verl's dataclass target",
    MT + "use_inference_chat_template": "not read by verl's agent loop (it belonged to verl's older sglang "
    "rollout): each turn is appended to the token ids already generated, as rlx's tool_call loop does",
    MT + "tokenization_sanity_check_mode": "a check of verl's older sglang rollout, not read by its agent loop: "
    "it changes no token",
    MT + "num_repeat_rollouts": "not read by verl's agent loop (rollout.n is the number of samples per prompt)",
    AGENT + "num_workers": "verl's agent-loop worker processes: " + _PLACEMENT,
}


def _is_true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def _turn_limit(value: Any, key: str) -> int | None:
    """verl's turn limit: a whole number, where ``null`` and 0 mean no limit (verl tests it for truth)."""
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _Unmapped(f"{value!r} is not a whole number of turns")
    return value


def _agent(verl: dict[str, Any], t: Translation, pm: Any) -> None:
    """verl's multi-turn settings (``actor_rollout_ref.rollout.multi_turn.*`` and ``.agent.*``) -> rlx's
    ``agent`` section: the tool_call loop, its limits, its format and the tools of verl's tool config."""
    keys = [k for k in verl if k.startswith((MT, AGENT))]
    loop_key = AGENT + "default_agent_loop"
    default_loop = verl.get(loop_key)
    on = _is_true(verl.get(MT + "enable"))
    if default_loop is not None and default_loop not in AGENT_LOOPS:
        t.unmapped.append((loop_key, f"verl's {default_loop} agent loop: rlx's loops are single_turn (verl's "
                           "single_turn_agent) and tool_call (tool_agent); another loop is an rlx agent_loop "
                           f"plugin ({_DOCS_AGENTS})"))
    elif AGENT_LOOPS.get(default_loop) == "tool_call":
        on = True
    if on:
        source = MT + "enable" if _is_true(verl.get(MT + "enable")) else loop_key
        t.set("agent.name", "tool_call", source)
        t.notes.append(f"{source}: rlx's tool_call agent loop for every prompt (verl picks the loop per row from "
                       f"the data's agent_name column, {default_loop or 'single_turn_agent'} where a row has none)")
        if default_loop == "single_turn_agent":
            t.notes.append(f"{loop_key}=single_turn_agent with multi_turn.enable: verl runs the tool loop only for "
                           "rows whose agent_name says tool_agent; rlx runs it for every row")
    for key in keys:
        try:
            _agent_key(key, verl[key], verl, t, on, pm)
        except _Ignored as exc:
            t.ignored.append((key, str(exc)))
        except _Unmapped as exc:
            t.unmapped.append((key, str(exc)))
    if on:
        _turns(verl, t)
        for key, target, default in ((MT + "max_parallel_calls", "agent.max_tool_calls", 1),
                                     (MT + "format", "agent.format", "hermes")):
            if target not in t.settings and verl.get(key) is None and not any(k == key for k, _ in t.unmapped):
                t.set(target, default, "verl default")  # verl's default, where rlx's differs


def _agent_key(key: str, value: Any, verl: dict[str, Any], t: Translation, on: bool, pm: Any) -> None:
    if key in AGENT_IGNORED:
        if AGENT_IGNORED[key]:
            raise _Ignored(AGENT_IGNORED[key])
        return
    if key == AGENT + "default_agent_loop":
        return  # read by _agent
    if key == AGENT + "agent_loop_config_path":
        if value is None:
            raise _Ignored("null: verl's own agent loops")
        raise _Unmapped(f"verl's custom agent loops are Python classes ({value}), which rlx never imports from a "
                        f"verl config; write the loop as an rlx agent_loop plugin ({_DOCS_AGENTS})")
    if key.startswith(AGENT + "custom_async_server."):
        if value is None:
            raise _Ignored("null: verl's own inference server")
        raise _Unmapped("a custom inference server class of verl's; rlx's engines are its rollout plugins")
    if key == MT + "interaction_config_path" and value is None:
        raise _Ignored("null: no simulated user")
    if not key.startswith(MT) or key.removeprefix(MT) not in (
            "max_assistant_turns", "max_user_turns", "max_parallel_calls", "max_tool_response_length",
            "tool_response_truncate_side", "format", "tool_config_path", "interaction_config_path"):
        raise _Unmapped("no rlx counterpart")
    if not on:
        if key == MT + "tool_config_path" and value is not None:
            raise _Unmapped("tools without the multi-turn loop: verl then runs its tool loop only for data rows "
                            "whose agent_name column says tool_agent, which rlx cannot see; add "
                            f"{MT}enable=True (verl's multi-turn examples set it in their --config-name file)")
        if key == MT + "interaction_config_path":
            raise _Unmapped("an interaction without the multi-turn loop: verl asks it only in its tool loop, which "
                            f"runs for data rows whose agent_name column says tool_agent; add {MT}enable=True")
        raise _Ignored("the multi-turn loop is off (multi_turn.enable is not true): verl does not read it")
    name = key.removeprefix(MT)
    if name in ("max_assistant_turns", "max_user_turns"):
        _turn_limit(value, key)  # checked here, combined by _turns
        return
    if name == "max_parallel_calls":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _Unmapped(f"{value!r} is not a whole number of calls of at least 1")
        t.set("agent.max_tool_calls", value, key)
        t.notes.append(f"{key}={value}: agent.max_tool_calls; verl drops the calls of a turn past it without a "
                       "word, rlx answers each with an error message")
    elif name == "max_tool_response_length":
        if value is None:
            raise _Ignored("null: rlx's default applies")
        t.set("agent.max_tool_response_length", value, key)
    elif name == "tool_response_truncate_side":
        if value not in TRUNCATE_SIDES:
            raise _Unmapped(f"verl's truncate sides are left, middle and right, not {value!r}")
        t.set("agent.tool_response_truncate_side", TRUNCATE_SIDES[value], key)
    elif name == "format":
        if value not in TOOL_FORMATS:
            raise _Unmapped(f"verl's {value} tool-call format; rlx's tool_call loop reads hermes and llama3 "
                            "(verl's llama3_json) tool calls")
        t.set("agent.format", TOOL_FORMATS[value], key)
    elif name == "tool_config_path":
        _tool_config(value, t, key, pm)
    elif name == "interaction_config_path":
        _interaction_config(value, t, key)


def _turns(verl: dict[str, Any], t: Translation) -> None:
    """verl ends an episode after max_assistant_turns model turns, or once max_user_turns tool turns are
    answered (the model's next turn is its last): at most min(assistant, user + 1) turns."""
    limits: list[tuple[int, str]] = []
    for name, extra in (("max_assistant_turns", 0), ("max_user_turns", 1)):
        key = MT + name
        try:
            limit = _turn_limit(verl.get(key), key)
        except _Unmapped:
            return  # reported by _agent_key
        if limit is not None:
            limits.append((limit + extra, key))
    if not limits:
        t.notes.append(f"{MT}max_assistant_turns and max_user_turns are null (verl's default): verl limits an "
                       "episode by data.max_response_length alone; rlx's agent.max_turns default of "
                       f"{_agent_default('max_turns')} applies (give agent.max_turns=N for longer episodes)")
        return
    turns, source = min(limits)
    t.set("agent.max_turns", turns, source)
    if source == MT + "max_user_turns":
        t.notes.append(f"{source}={turns - 1}: after {turns - 1} user turns (tool results or an interaction's "
                       f"replies) verl lets the model answer once more, so agent.max_turns={turns}")


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _tool_options(pm: Any, name: str) -> dict[str, Any]:
    """The option fields of the rlx tool ``name`` ({} when it is not installed)."""
    try:
        model = pm.get("tool", name).load_config_model() if pm is not None else None
    except Exception:
        return {}
    return dict(model.model_fields) if model is not None else {}


def _agent_default(name: str) -> Any:
    from rlx.config import AgentConfig

    return AgentConfig.model_fields[name].default


def _verl_interaction_name(entry: dict[str, Any]) -> Any:
    """The name verl gives an interaction: its ``name``, else its class's name less ``Interaction``, lower-cased."""
    if entry.get("name") is not None:
        return entry["name"]
    simple = str(entry["class_name"]).rsplit(".", 1)[-1]
    return (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def _read_yaml(key: str, text: str, what: str, hint: str) -> Any:
    """The YAML data of the file ``text`` that verl's ``key`` names (its ``what`` config), read as data; a file that
    is unreadable, not UTF-8 or not YAML is a user error (exit 2)."""
    import yaml

    try:
        return yaml.safe_load(Path(text).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"--from-verl: {key}={text}: not a text file (it is not UTF-8); verl's {what} config is "
                        "YAML.", hint) from None
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"--from-verl: {key}={text}: cannot read it as YAML: {exc}", hint) from None


def _interaction_config(value: Any, t: Translation, key: str) -> None:
    """verl's interaction YAML (``interaction: [{name, class_name, config}]``), read as data (never imported or
    run): its gsm8k interaction is rlx's ``gsm8k``; another class is named as unmapped. A file that is missing,
    unreadable or not such a YAML is a user error (exit 2)."""
    text = os.path.expanduser(str(value))
    hint = ("Give the path of verl's interaction config YAML (interaction: [{name: ..., class_name: ..., "
            "config: {...}}]), or run rlx where the file is (verl's multi-turn examples expect verl's checkout as "
            "the working folder).")
    if not Path(text).exists():
        raise UserError(f"--from-verl: {key}={text}: no such file; rlx reads verl's interaction config to choose "
                        "its interactions.", hint)
    data = _read_yaml(key, text, "interaction", hint)
    entries = data.get("interaction") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(x, dict) and isinstance(x.get("class_name"), str)
                                                for x in entries):
        raise UserError(f"--from-verl: {key}={text}: not a verl interaction config: it needs a top-level "
                        "'interaction' list whose entries name a class_name.", hint)
    names: list[str] = []
    for entry in entries:
        cls, verl_name = entry["class_name"], _verl_interaction_name(entry)
        if cls != GSM8K_INTERACTION:
            t.unmapped.append((key, f"interaction {cls}: a Python class of verl's, which rlx never imports from a "
                               "verl config; rlx's built-in interaction is gsm8k (verl's Gsm8kInteraction), another "
                               f"is an rlx interaction plugin ({_DOCS_AGENTS})"))
            continue
        if verl_name != "gsm8k":
            t.unmapped.append((key, f"interaction {cls} named {verl_name!r}: the data's "
                               "extra_info.interaction_kwargs.name picks an interaction by name, and rlx's is "
                               "named gsm8k; name it gsm8k in the config and the data"))
            continue
        if "gsm8k" not in names:
            names.append("gsm8k")
        if entry.get("config"):
            t.notes.append(f"{key}: the gsm8k interaction's config {entry['config']!r} is not carried over (verl's "
                           "Gsm8kInteraction reads none of it)")
        t.notes.append(f"{key}: verl's gsm8k interaction is rlx's gsm8k interaction (agent.interactions=[gsm8k]): "
                       "after each answer without a tool call it checks the number after the last #### against the "
                       "row's ground truth; right ends the episode (turn score 1), wrong gets a user turn asking the "
                       "model to try again (0), read and not trained. Rows pick it by "
                       "extra_info.interaction_kwargs.name (verl's gsm8k_multiturn_w_interaction data; rows without "
                       "it use the only interaction on). The turn scores reach the reward as "
                       "extra_info['turn_scores'], as in verl; the reward itself is the reward plugin's")
    if names:
        t.set("agent.interactions", names, key)
    elif not entries:
        t.ignored.append((key, "the interaction config lists no interactions"))


def _tool_config(value: Any, t: Translation, key: str, pm: Any) -> None:
    """verl's tool YAML (``tools: [{class_name, config, tool_schema}]``), read as data (never imported or run):
    its sandbox-fusion code tool is rlx's python tool; a tool rlx has no counterpart for is named."""
    if value is None:
        raise _Ignored("null: no tools")
    text = os.path.expanduser(str(value))
    if not Path(text).exists():
        raise _Unmapped(f"the tool config {text} is not on this machine; rlx reads it to choose its tools (verl's "
                        "multi-turn examples expect verl's checkout as the working folder): run rlx where the file "
                        "is, or leave the key out and set agent.tools=[...] yourself")
    data = _read_yaml(key, text, "tool", "Give the path of verl's tool config YAML.")
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, list) or not all(isinstance(x, dict) and isinstance(x.get("class_name"), str)
                                              for x in tools):
        raise UserError(f"--from-verl: {key}={text}: not a verl tool config: it needs a top-level 'tools' list "
                        "whose entries name a class_name.", "Give the path of verl's tool config YAML "
                        "(tools: [{class_name: ..., config: {...}, tool_schema: {...}}]).")
    names: list[str] = []
    for tool in tools:
        cls = tool["class_name"]
        if cls == GSM8K_TOOL:
            if "calc_gsm8k_reward" not in names:
                names.append("calc_gsm8k_reward")
            t.notes.append(f"{key}: verl's gsm8k tool is rlx's calc_gsm8k_reward tool: the model submits an answer "
                           "and reads whether it matches the row's ground truth (verl's flexible extraction); verl's "
                           "-0.05 tool reward for a repeated wrong answer is not added (the reward is the reward "
                           "plugin's, on the final turn)")
            continue
        if cls != SANDBOX_FUSION:
            why = REFUSED_TOOLS.get(cls, f"{cls} is a Python class of verl's, which rlx never imports from a verl "
                                    f"config; write the tool as an rlx tool plugin ({_DOCS_AGENTS})")
            t.unmapped.append((key, f"tool {cls}: {why}"))
            continue
        config = tool.get("config") if isinstance(tool.get("config"), dict) else {}
        language = config.get("default_language", "python")
        if language != "python":
            t.unmapped.append((key, f"tool {cls} with default_language={language}: rlx's python tool runs Python"))
            continue
        if "python" not in names:
            names.append("python")
        options = _tool_options(pm, "python")
        timeout = config.get("default_timeout")
        if _positive(timeout) and "timeout_s" in options:  # the program's own limit, as Sandbox Fusion's
            t.set("tools.python.timeout_s", float(timeout), key)
            limit = _agent_default("tool_timeout_s")
            if timeout >= limit:  # the call's limit stays above the program's, so the sandbox ends it first
                t.set("agent.tool_timeout_s", float(timeout) + 5, key)
        memory = config.get("memory_limit_mb")
        if _positive(memory) and "memory_mb" in options and memory >= 64:
            t.set("tools.python.memory_mb", int(memory), key)
        elif memory is not None:
            t.notes.append(f"{key}: verl's memory_limit_mb={memory} is not carried over (rlx's python tool takes "
                           "tools.python.memory_mb of at least 64)")
        schema = tool.get("tool_schema") if isinstance(tool.get("tool_schema"), dict) else {}
        function = schema.get("function") if isinstance(schema.get("function"), dict) else {}
        shown = f" (verl's schema names it {function['name']})" if isinstance(function.get("name"), str) else ""
        t.notes.append(f"{key}: verl's sandbox-fusion code tool is rlx's python tool{shown}, shown to the model "
                       "with rlx's own schema; rlx runs the code in a local bubblewrap sandbox, not on a Sandbox "
                       "Fusion service (its url, rate limits and workers do not apply)")
    if names:
        t.set("agent.tools", names, key)
    elif not tools:
        t.ignored.append((key, "the tool config lists no tools"))


def _count(verl: dict[str, Any], key: str) -> int:
    """A whole number of nodes or GPUs (1 when unset); anything else is the user's error, named."""
    value = verl.get(key, 1)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"--from-verl: {key}={value!r} is not a whole number of at least 1.",
                        f"Give {key} as a whole number, e.g. {key}=1.")
    return value


def translate(source: str | dict[str, Any], pm: Any = None, environ: Mapping[str, str] | None = None) -> Translation:
    """The rlx settings for a verl command line or script, YAML path, or dict of verl keys (``environ``: the
    environment a script's variables come from, ``os.environ`` by default)."""
    t = Translation()
    verl = read_verl_source(source, environ, t.notes) if isinstance(source, str) else dict(source)
    if "algorithm.adv_estimator" not in verl:
        t.set("algorithm.name", "ppo", "verl default")
        t.notes.append("no algorithm.adv_estimator: verl's default is gae, rlx's ppo algorithm")
    _reward(verl, t)
    _vision(verl, t)
    nodes, per_node = _count(verl, "trainer.nnodes"), _count(verl, "trainer.n_gpus_per_node")
    if nodes > 1:
        t.set("launcher.name", "ray", "trainer.nnodes")
    gpus = per_node * nodes
    if gpus > 1:
        t.set("launcher.nproc", gpus, "trainer.n_gpus_per_node x trainer.nnodes")
    device = verl.get("trainer.device")
    if device not in (None, "cuda", "cpu"):
        t.unmapped.append(("trainer.device", f"rlx runs on cuda or cpu, not {device}"))
    elif device is not None:
        t.set("trainer.device", device, "trainer.device")

    # The engine first: the engine settings that follow map onto its options.
    _rollout_name(verl.get(RO + "name", "vllm"), t, pm)
    _backend(verl, t)
    _agent(verl, t, pm)
    for key, value in verl.items():
        if key == RO + "name" or key == AA + "strategy" or key.startswith((MEGATRON, MT, AGENT)):
            continue
        if key.startswith("~"):
            t.unmapped.append((key, "Hydra key deletion"))
            continue
        try:
            if key in SPECIAL:
                SPECIAL[key](value, t, verl, pm)
            elif key in DIRECT:
                target = DIRECT[key]
                if key.startswith("reward_model.") and not verl.get("reward_model.enable"):
                    raise _Ignored("reward_model.enable is not true")
                if key.startswith("custom_reward_function.") and t.settings.get("reward.name") != "custom":
                    continue  # reported by _reward
                if key.startswith("critic.") and t.settings.get("algorithm.name") != "ppo" \
                        and verl.get("algorithm.adv_estimator", "gae") != "gae":
                    raise _Ignored("no critic: the algorithm does not use one")
                if value is None:
                    raise _Ignored(f"null: rlx's default for {target} applies")
                if not _core_or_option_key_exists(target, t.settings, pm):
                    raise _Unmapped(f"this rlx has no {target}")
                t.set(target, value, key)
            else:
                if key.startswith("async_training."):
                    raise _Unmapped("verl's fully-async recipe; in rlx set trainer.max_staleness=K (a bound in policy "
                                    "versions, not a share of samples), rollout.partial=true and "
                                    "launcher.rollout_nproc=N by hand: docs/rollout.md")
                if key.startswith(OVERRIDE_OPTIMIZER):
                    _override_optimizer(key, value, verl)
                if key.startswith(RM_ROLLOUT):
                    _reward_engine(key, verl)
                if key in VISION_KEYS:
                    _vision_key(key, value, t)
                    continue
                if key.startswith(MODEL + "override_config"):
                    _override_config(key, value, t)
                    continue
                if key.startswith(TEMPLATE_KWARGS):
                    _template_kwargs(key, value, t)
                    continue
                if key.startswith(MODEL + "lora."):
                    _megatron_lora(key.removeprefix(MODEL + "lora."), value, t, verl)
                    continue
                why = _is_ignored(key)
                if why is None:
                    missing = next((w for k, w in MISSING.items() if key == k or (k.endswith(".") and
                                                                                  key.startswith(k))), None)
                    raise _Unmapped(missing or "no rlx counterpart" + _verl_key_meant(key))
                if why:
                    t.ignored.append((key, why))
        except _Ignored as exc:
            t.ignored.append((key, str(exc)))
        except _Unmapped as exc:
            t.unmapped.append((key, str(exc)))

    for key, value in VERL_DEFAULTS.items():
        if key not in t.settings:
            t.set(key, value, "verl default")
    _reward_context(verl, t)
    _random_sampler(verl, t)
    if t.settings.get("rollout.val_temperature") is None and "rollout.val_temperature" in t.settings:
        del t.settings["rollout.val_temperature"]
    for key in ("model.lora_rank", "model.lora_adapter_path"):  # set by a converter: report it when this rlx lacks it
        if key in t.settings and not _core_or_option_key_exists(key, t.settings, pm):
            t.unmapped.append((t.sources.pop(key), f"this rlx has no {key}"))
            del t.settings[key]
    _adapter_settings(t)
    _check_epochs(t)
    _validation_before_training(t)
    _bypass_loss(t)
    _drop_remote_code(t)
    return t


def _validation_before_training(t: Translation) -> None:
    """verl validates once before training whenever val_before_train is on (its default), whatever test_freq says;
    rlx's test_freq of -1 or 0 turns every validation off, that one included: say so."""
    freq = t.settings.get("trainer.test_freq")
    if t.settings.get("trainer.val_before_train") and isinstance(freq, int) and freq <= 0 \
            and t.settings.get("data.val_files"):
        t.notes.append(f"trainer.test_freq={freq} with trainer.val_before_train=True: verl still validates once "
                       "before training, rlx then validates never; give trainer.test_freq=N (every N steps) to have "
                       "the validation before training too")


def _drop_remote_code(t: Translation) -> None:
    """A verl config never runs code by itself: ``trust_remote_code`` (a model folder's own Python) and the
    custom reward's file are left out, each with a note saying how to ask for it on the command line."""
    for key in ("model.trust_remote_code", "reward.trust_remote_code"):
        value = t.settings.get(key)
        if key in t.settings and value not in (False, None, "false", "False", 0):
            source = t.sources.pop(key, key)
            del t.settings[key]
            t.notes.append(f"{source}={value} is left out: rlx runs a model folder's own code only when you ask "
                           f"on its command line; add {key}=true to the rlx command if you trust that code")
    path = t.settings.get("reward.path")
    if t.settings.get("reward.name") == "custom" and isinstance(path, str) and path:  # importing the file runs it
        source = t.sources.pop("reward.path", "custom_reward_function.path")
        del t.settings["reward.path"]
        t.notes.append(f"{source}={path} is left out: rlx imports a reward file only when you name it on its "
                       f"command line; add reward.path={path} to the rlx command if you trust that code")


def _check_epochs(t: Translation) -> None:
    if "trainer.total_steps" not in t.settings:
        t.notes.append(f"trainer.total_epochs={t.settings['trainer.total_epochs']}: as in verl, one step per "
                       "data.train_batch_size prompts and an epoch's last, partial batch left out")
