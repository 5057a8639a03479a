"""The run configuration: pydantic v2 models, layered sources, and error reports a user can act on.

Sources, later wins: defaults < preset < YAML files (``--config``, in order) < shortcut flags (``--backend``,
``--rollout``, ``--algorithm``, ``--reward``, ``--model``) < dotted overrides (``actor.optim.lr=1e-6``).

The sections ``backend``, ``rollout``, ``algorithm``, ``reward`` and ``launcher`` name a plugin
(``name``); their other keys are that plugin's options and are validated by its config model.
"""

from __future__ import annotations

import copy
import datetime
import os
import string
import types
from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlx.errors import ConfigError, did_you_mean

PRESET_DIR = Path(__file__).parent / "presets"

# Upper bounds of the numeric options. Each is far above any real run and low enough that a typo
# (``rollout.n=1e19``, ``lr=1e308``) is reported here instead of overflowing int64 or turning the weights
# into inf inside torch: batch x samples x (prompt + response) tokens is at most 2**57 elements.
MAX_TOKENS = 2**20  # data.max_prompt_length, data.max_response_length
MAX_BATCH = 2**20  # batch and micro-batch sizes, reward.chunk_size, trainer.log_samples
MAX_TOKEN_BUDGET = 2**31  # tokens per micro-batch (dynamic batch size) and per head chunk
MAX_SAMPLES = 2**16  # rollout.n, rollout.val_n
MAX_STEPS = 10**9  # steps, epochs, frequencies, warm-up steps, checkpoints kept
MAX_STALENESS = 16  # trainer.max_staleness: policy versions a rollout may lag behind the trainer
MAX_PPO_EPOCHS = 1024
MAX_LR = 1.0  # Adam moves each weight by about lr per step: above 1 a single step destroys the model
MAX_WEIGHT_DECAY = 1.0  # AdamW multiplies the weights by (1 - lr * weight_decay) each step
MIN_TEMPERATURE = 1e-3  # logits / temperature must stay finite in bfloat16 and float16
MAX_TEMPERATURE = 100.0  # far above this, sampling is uniform over the vocabulary
MAX_TOP_K = 2**31 - 1
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # one week; Python's own limit on a wait is about 292 years
MAX_WORKERS = 1024
MAX_TURNS = 1024  # agent.max_turns: assistant turns of one episode
MAX_SEED = 2**32 - 1  # the widest seed every RNG in use takes (numpy, vLLM)
MAX_LORA_RANK = 2**16  # model.lora_rank, model.lora_alpha: far above any model's width

# apply_chat_template's arguments that rlx sets where it renders a conversation (data.apply_chat_template_kwargs
# may not): the conversation itself, what is returned, the tools listed, and whether an assistant turn is opened.
CHAT_TEMPLATE_OWNED = ("conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                       "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")

# ``trainer.output_dir`` may name these; anything else in braces is an error.
OUTPUT_DIR_PLACEHOLDERS = ("project", "experiment")

_Beta = Annotated[float, Field(ge=0, lt=1)]


class _Section(BaseModel):
    # coerce_numbers_to_str: ``trainer.experiment=2024`` is read as the int 2024 but meant as a name.
    # allow_inf_nan=False: no option of the core means anything at inf or nan.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True,
                              allow_inf_nan=False)


class ModelConfig(_Section):
    path: str = Field("", description="Hugging Face hub id or local folder of the policy model.")
    tokenizer_path: str | None = Field(None, description="Tokenizer location; defaults to `path`.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype of the models. auto: float32 on a CPU, bfloat16 on a GPU. "
        "A trained model keeps float32 master weights on a GPU; on a CPU it trains in this dtype.")
    router_dtype: Literal["auto", "float32"] = Field(
        "auto", description="Dtype of the mixture-of-experts routers' gate (megatron-core's moe_router_dtype). "
        "auto: as the Hugging Face model computes it (Qwen-MoE's, Mixtral's and Qwen3-VL-MoE's in model.dtype; "
        "DeepSeek-V3's in float32). float32: the gate's input and weight cast to float32 for its matmul, its "
        "softmax and top-k in float32 (the experts unchanged), in the policy, the reference and the hf rollout "
        "engine (and a critic built from an MoE model); vLLM and SGLang have no such switch, so their routers "
        "compute in their dtype. A dense model has no router: nothing changes (a warning says so).")
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations to save memory.")
    lora_rank: int = Field(0, ge=0, le=MAX_LORA_RANK, description="LoRA through peft (`pip install 'rlx[peft]'`): "
                           "the rank of the adapters; 0 trains every weight. With LoRA only the adapters train "
                           "(the base stays frozen in model.dtype) and the reference is the base with the adapter "
                           "switched off; see docs/lora.md.")
    lora_alpha: float = Field(16, gt=0, le=MAX_LORA_RANK, description="LoRA scaling: the update is "
                              "lora_alpha / lora_rank * B @ A.")
    target_modules: str | list[str] = Field(
        "all-linear", description="Modules that get adapters: all-linear (every linear layer but the output "
        "head), or a list of module names or name suffixes (q_proj, v_proj, ...).")
    exclude_modules: list[str] = Field(default_factory=list,
                                       description="Module names or name suffixes that get no adapter; an "
                                       "entry with a regular expression's characters matches modules by their full "
                                       "name (e.g. '.*visual.*': a vision-language model's vision tower).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input while training.")
    lora_adapter_path: str | None = Field(
        None, description="A saved peft LoRA adapter folder (adapter_config.json, adapter_model.safetensors) that "
        "the training starts from instead of new adapters. Read when training starts: its r, lora_alpha, "
        "target_modules, exclude_modules and lora_dropout fill the model.lora_* options left unset (a "
        "model.lora_rank or lora_alpha given otherwise is an error). The reference stays the base with the "
        "adapter switched off; a resumed run takes its weights from its checkpoint. See docs/lora.md.")
    override_config: dict[str, Any] = Field(
        default_factory=dict, description="Attributes of the model's Hugging Face config (config.json) set before "
        "the model is built, e.g. model.override_config.max_position_embeddings=32768; a mapping sets the "
        "attributes of a sub-config (text_config: {...}). Applied wherever the model is loaded: the policy, the "
        "reference, the critic and the rollout engines (hf; vLLM's hf_overrides, SGLang's "
        "json_model_override_args). An attribute the config does not have is a config error.")

    @field_validator("override_config")
    @classmethod
    def _attribute_names(cls, v: dict[str, Any]) -> dict[str, Any]:
        def check(tree: dict[str, Any], where: str) -> None:
            for key, value in tree.items():
                if not isinstance(key, str) or not key.isidentifier():
                    raise ValueError(f"the key {where}{key} is not an attribute name (a Python identifier)")
                if isinstance(value, dict):
                    check(value, f"{where}{key}.")
        check(v, "")
        return v

    # Before pydantic's own checks: the section coerces numbers to strings, and 5 is no module's name.
    @field_validator("target_modules", mode="before")
    @classmethod
    def _modules_named(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip() == "all-linear":
            return "all-linear"
        return _module_names(v, "give all-linear or a non-empty list of module names, e.g. [q_proj,v_proj]")

    @field_validator("exclude_modules", mode="before")
    @classmethod
    def _one_or_many_excluded(cls, v: Any) -> Any:
        return _module_names(v, "give a list of module names, e.g. [lm_head]", empty_ok=True)

    @field_validator("lora_adapter_path", mode="before")
    @classmethod
    def _no_adapter_when_empty(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v


def _module_names(v: Any, accepted: str, empty_ok: bool = False) -> list[str]:
    """Module names given as a list, one name, or names separated by commas; anything else (a number, a
    mapping, an empty name) is refused with ``accepted``."""
    if isinstance(v, str):
        v = [name.strip() for name in v.split(",")] if v.strip() else []
    if not isinstance(v, list | tuple) or (not v and not empty_ok):
        raise ValueError(accepted)
    for name in v:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{accepted}; {name!r} is not a module name")
    return [name.strip() for name in v]


class DataConfig(_Section):
    train_files: list[str] = Field(default_factory=list, description="Parquet files of training prompts.")
    val_files: list[str] = Field(default_factory=list, description="Parquet files of validation prompts.")
    prompt_key: str = Field("prompt", description="Column holding the chat messages of each prompt.")
    image_key: str = Field("images", description="Column holding each prompt's images (a vision-language model "
                           "reads them; `<image>` in the messages marks where each goes): encoded image files or "
                           "paths. Rows without it are text only.")
    max_prompt_length: int = Field(512, gt=0, le=MAX_TOKENS,
                                   description="Prompts longer than this (in tokens) are dropped.")
    max_response_length: int = Field(512, gt=0, le=MAX_TOKENS, description="Most tokens generated per response.")
    train_batch_size: int = Field(32, gt=0, le=MAX_BATCH, description="Prompts per training step.")
    val_batch_size: int = Field(64, gt=0, le=MAX_BATCH, description="Prompts per validation generate call.")
    shuffle: bool = Field(True, description="Shuffle training prompts every epoch.")
    filter_overlong_prompts: bool = Field(
        True, description="Drop (and count) prompts over max_prompt_length; if false they are an error.")
    apply_chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Further keyword arguments of the tokenizer's apply_chat_template, "
        "wherever rlx renders a conversation: the training and validation prompts, rlx eval's, and the turns of "
        "multi-turn episodes; the template reads them as variables (gpt-oss: reasoning_effort=medium; Qwen3: "
        "enable_thinking=false). Arguments rlx sets itself (tokenize, add_generation_prompt, tools, ...) are "
        "refused.")

    @field_validator("apply_chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in v:
            if not isinstance(key, str) or not key.isidentifier():
                raise ValueError(f"the key {key!r} is not a template variable name (a Python identifier)")
            if key in CHAT_TEMPLATE_OWNED:
                raise ValueError(f"{key} is set by rlx where it renders a conversation (rlx sets "
                                 f"{', '.join(CHAT_TEMPLATE_OWNED)})")
        return v

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class OptimConfig(_Section):
    lr: float = Field(1e-6, gt=0, le=MAX_LR, description=f"Peak learning rate (at most {MAX_LR:g}).")
    weight_decay: float = Field(0.01, ge=0, le=MAX_WEIGHT_DECAY, description="AdamW weight decay.")
    betas: tuple[_Beta, _Beta] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear warm-up steps.")
    warmup_ratio: float | None = Field(None, ge=0, le=1, description="The warm-up as a fraction of all of "
                                       "training's optimizer steps (instead of warmup_steps), as verl's "
                                       "lr_warmup_steps_ratio.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="After warm-up.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final lr as a fraction of lr (cosine/linear).")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")

    @model_validator(mode="after")
    def _one_warmup(self) -> OptimConfig:
        if self.warmup_ratio is not None and self.warmup_steps:
            raise ValueError(f"give warmup_steps ({self.warmup_steps}) or warmup_ratio ({self.warmup_ratio}), "
                             "not both")
        return self

    def warmup_for(self, total_steps: int) -> int:
        """The warm-up in optimizer steps, of ``total_steps`` in all."""
        return self.warmup_steps if self.warmup_ratio is None else int(self.warmup_ratio * total_steps)


class ActorConfig(_Section):
    optim: OptimConfig = Field(default_factory=OptimConfig)
    model_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The trained weights' dtype: float32 (master weights and AdamW states in float32, "
        "forward passes autocast to model.dtype on a GPU) or bfloat16 (weights, gradients and AdamW moments in "
        "bf16, no autocast: half the memory, as TRL and verl's fsdp_config.model_dtype=bf16).")
    ppo_mini_batch_size: int = Field(
        16, gt=0, le=MAX_BATCH, description="Prompts per optimizer step (times rollout.n sequences).")
    micro_batch_size_per_device: int = Field(
        4, gt=0, le=MAX_BATCH, description="Sequences per forward/backward pass; gradients accumulate over them.")
    log_prob_micro_batch_size_per_device: int = Field(
        16, gt=0, le=MAX_BATCH, description="Sequences per forward pass when computing log-probs (no gradients).")
    ppo_epochs: int = Field(1, gt=0, le=MAX_PPO_EPOCHS, description="Passes over each step's rollouts.")
    shuffle: bool = Field(False, description="Shuffle sequences between PPO epochs.")
    freeze_vision_tower: bool = Field(
        False, description="A vision-language model's vision tower (its `visual` module, LoRA adapters on it too) "
        "does not train; the language model does (verl's actor.freeze_vision_tower). docs/vision.md.")
    recompute_old_log_prob: bool | Literal["auto"] = Field(
        "auto", description="The old-log-prob pass before the update. With ppo_epochs=1 and one mini-batch per step "
        "(ppo_mini_batch_size = data.train_batch_size) the update's own forward runs the policy that scored the "
        "rollouts, so the loss can take its log-probs, detached, as the old ones (ratio 1: the same gradient, one "
        "forward pass fewer). auto: skip the pass exactly then, unless the algorithm needs the old log-probs "
        "before the update (use_kl_in_reward); true: always run it; false: never (a config error where the update "
        "is not on-policy).")
    use_remove_padding: bool = Field(
        True, description="Packed sequences: a micro-batch's rows go through the model as one row without "
        "padding, attention kept within each sequence (models on transformers' attention interface; others "
        "stay padded). Also the reference's setting.")
    share_prompts: bool = Field(
        True, description="With packed sequences, the rows of a micro-batch that share a prompt (a GRPO group's "
        "responses) carry it through the model once: each response attends to the one copy of the prompt, so "
        "the log-probs and gradients are those of the rows apart, and the prompt's tokens count once against "
        "the token budgets. Models on rlx's packed attention (transformers' sdpa); others, and Ulysses, "
        "pack every row whole. Also the reference's setting. docs/throughput.md.")
    use_dynamic_bsz: bool = Field(
        False, description="Cut micro-batches by a token budget (ppo_max_token_len_per_gpu, "
        "log_prob_max_token_len_per_gpu) instead of a row count; the reference follows the log-prob budget.")
    ppo_max_token_len_per_gpu: int = Field(
        16384, gt=0, le=MAX_TOKEN_BUDGET, description="Most prompt + response tokens in one forward/backward "
        "micro-batch (use_dynamic_bsz).")
    log_prob_max_token_len_per_gpu: int = Field(
        16384, gt=0, le=MAX_TOKEN_BUDGET, description="Most prompt + response tokens in one log-prob forward "
        "pass (use_dynamic_bsz; the reference too).")
    log_prob_chunk_size: int = Field(
        1024, ge=0, le=MAX_TOKEN_BUDGET, description="Log-probs and entropy from the head this many response "
        "positions at a time (compute dtype, float32 reduction), never a float32 copy of all the logits; "
        "0: the plain path (all response logits in float32).")
    ulysses_sequence_parallel_size: int = Field(
        1, ge=1, le=1024, description="Ulysses sequence parallelism: each sequence's tokens split over this many "
        "processes (fsdp/fsdp2 backends, packed sequences); must divide the processes and the attention heads.")
    use_torch_compile: bool = Field(
        False, description="torch.compile each decoder layer of the trained model (torch, fsdp2 and megatron backends; "
        "dynamic shapes, one graph shared by the layers) and the chunked head's per-chunk log-softmax, entropy "
        "and logit-gradient work: fuses the norms, activations and casts between the matrix products, and "
        "reads each chunk of logits once or twice instead of once per operation. Costs 20-30 s of compilation "
        "at the first step; pays on a GPU (measured on an H200 with bf16 weights: the actor update at 56-60% MFU "
        "at 0.5B and 72% at 1.5B, against 31% at 0.5B uncompiled; 1.1x under gradient checkpointing at equal "
        "settings; docs/benchmarks.md). The log-prob passes of the "
        "same model use it too. With model.gradient_checkpointing the layers checkpoint inside the compiled graph.")


class CriticOptimConfig(OptimConfig):
    lr: float = Field(1e-5, gt=0, le=MAX_LR, description=f"Peak learning rate of the critic (at most {MAX_LR:g}).")


class CriticConfig(_Section):
    """The value model; built only when the algorithm needs one (``ppo``, or ``adv_estimator=gae``)."""

    model_path: str | None = Field(
        None, description="Checkpoint of the value model; defaults to model.path (a fresh value head on it).")
    optim: CriticOptimConfig = Field(default_factory=CriticOptimConfig,
                                     description="The critic's own optimizer (lr default 1e-5).")
    model_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The trained weights' dtype: float32 (master weights and AdamW states in float32, "
        "forward passes autocast to model.dtype on a GPU) or bfloat16 (weights, gradients and AdamW moments in "
        "bf16, no autocast: half the memory, as TRL and verl's fsdp_config.model_dtype=bf16).")
    micro_batch_size_per_device: int = Field(
        4, gt=0, le=MAX_BATCH, description="Sequences per forward/backward pass; gradients accumulate over them.")
    forward_micro_batch_size_per_device: int = Field(
        16, gt=0, le=MAX_BATCH, description="Sequences per forward pass when computing values (no gradients).")
    ppo_epochs: int | None = Field(None, gt=0, le=MAX_PPO_EPOCHS,
                                   description="Passes over each step's rollouts (default actor's).")
    cliprange_value: float | None = Field(
        0.5, gt=0, description="Clip new values to old +- this in the value loss (null: no clipping).")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS,
                              description="First steps in which only the critic trains (the actor waits).")
    use_remove_padding: bool = Field(True, description="Packed sequences for the critic (see "
                                     "actor.use_remove_padding).")
    share_prompts: bool = Field(True, description="The critic's rows that share a prompt carry it once (see "
                                "actor.share_prompts).")
    use_dynamic_bsz: bool = Field(
        False, description="Cut the critic's micro-batches by a token budget (ppo_max_token_len_per_gpu, "
        "forward_max_token_len_per_gpu) instead of a row count.")
    ppo_max_token_len_per_gpu: int = Field(
        32768, gt=0, le=MAX_TOKEN_BUDGET, description="Most prompt + response tokens in one forward/backward "
        "micro-batch of the critic (use_dynamic_bsz).")
    forward_max_token_len_per_gpu: int = Field(
        32768, gt=0, le=MAX_TOKEN_BUDGET, description="Most prompt + response tokens in one value forward pass "
        "(use_dynamic_bsz).")
    ulysses_sequence_parallel_size: int = Field(
        1, ge=1, le=1024, description="Ulysses sequence parallelism: each sequence's tokens split over this many "
        "processes (fsdp/fsdp2 backends, packed sequences); must divide the processes and the attention heads.")
    use_torch_compile: bool = Field(False, description="torch.compile each decoder layer of the critic (see "
                                    "actor.use_torch_compile).")


class ComponentSection(BaseModel):
    """A section that names a plugin. Keys other than ``name`` are the plugin's own options."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, coerce_numbers_to_str=True,
                              allow_inf_nan=False)
    name: str

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class BackendConfig(ComponentSection):
    name: str = Field("torch", description="Training backend plugin.")


class LauncherConfig(ComponentSection):
    name: str = Field("local", description="Launcher plugin that places the workers.")


class RolloutConfig(ComponentSection):
    name: str = Field("hf", description="Rollout engine plugin.")
    n: int = Field(8, gt=0, le=MAX_SAMPLES, description="Responses sampled per prompt (the group of GRPO-like "
                   "algorithms; 1 for PPO with a critic is possible).")
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE,
                               description=f"Sampling temperature: 0 (greedy) or {MIN_TEMPERATURE:g} to "
                               f"{MAX_TEMPERATURE:g}.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K, description="Top-k sampling (-1 = off).")
    val_temperature: float = Field(0.0, ge=0, le=MAX_TEMPERATURE,
                                   description="Temperature for validation (0 = greedy).")
    val_n: int = Field(1, gt=0, le=MAX_SAMPLES, description="Responses per prompt during validation.")
    val_top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass during validation "
                                    "(default: top_p).")
    val_top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="Top-k during validation (-1 = off; "
                                  "default: top_k).")
    partial: bool = Field(False, description="Partial rollouts (with trainer.max_staleness >= 2): at each step "
                          "boundary the generation under way stops where it is; finished groups are trained on, "
                          "unfinished responses continue in the next rollout with the newer weights (their tokens "
                          "keep the version that made them), so one long response never stalls a step. An engine "
                          "that can be interrupted is needed (hf).")

    @field_validator("temperature", "val_temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}: dividing the logits by a "
                             f"smaller temperature overflows them")
        return v


class AlgorithmConfig(ComponentSection):
    name: str = Field("grpo", description="Algorithm plugin (advantages and losses).")


class RewardConfig(ComponentSection):
    name: str = Field("gsm8k", description="Reward plugin.")
    # How the reward plugin is run (rlx.run.rewards); the plugin's own options are the other keys.
    on_error: Literal["fail", "zero"] = Field(
        "fail", description="A reward call that raises, hangs, returns NaN or the wrong number of scores: "
        "'fail' stops the run with a message naming the plugin and the response; 'zero' gives those "
        "responses failure_score and counts them in the reward/failed metrics.")
    failure_score: float = Field(0.0, description="Score of a response whose reward failed (on_error=zero).")
    timeout_s: float = Field(300.0, ge=0, le=MAX_TIMEOUT_S,
                             description="Most seconds one reward call may take (0: no limit; at most a week).")
    num_workers: int = Field(1, ge=1, le=MAX_WORKERS,
                             description="Reward calls run at the same time (threads or processes).")
    chunk_size: int = Field(
        0, ge=0, le=MAX_BATCH, description="Responses per reward call (0: the batch split evenly over num_workers).")
    executor: Literal["thread", "process"] = Field(
        "thread", description="'thread': calls run in threads (reward models, I/O); 'process': each call in "
        "a forked process that is killed when it times out (CPU-heavy rule rewards; Linux/macOS).")


class AgentConfig(ComponentSection):
    """Multi-turn rollouts (rlx.agent): the agent loop that drives each episode, the tools its model may call, and
    the limits every loop is held to. The loop's own options are the section's other keys."""

    name: str = Field("single_turn", description="Agent-loop plugin: single_turn (one response per prompt, "
                      "the engine called directly) or tool_call (turns with tool calls, in the chat template's "
                      "format).")
    tools: list[str] = Field(default_factory=list, description="Tool plugins the model may call (tools.NAME.* "
                             "are their options); the prompts' chat template lists them.")
    max_turns: int = Field(4, ge=1, le=MAX_TURNS, description="Assistant turns per episode, at most; an episode "
                           "still calling tools then ends (verl: multi_turn.max_assistant_turns).")
    max_tool_calls: int = Field(4, ge=1, le=MAX_WORKERS, description="Tool calls run per assistant turn; calls "
                                "past it get an error turn (verl: multi_turn.max_parallel_calls).")
    max_tool_response_length: int = Field(
        256, ge=1, le=MAX_TOKENS, description="Characters of one tool result kept for the model (verl: "
        "multi_turn.max_tool_response_length); the rest is cut at tool_response_truncate_side. The episode's "
        "tokens, tool outputs included, stay within data.max_response_length.")
    tool_response_truncate_side: Literal["left", "middle", "right"] = Field(
        "middle", description="Which part of a long tool result is kept (verl's meaning): left its start, right its "
        "end, middle both ends.")
    tool_timeout_s: float = Field(30.0, gt=0, le=MAX_TIMEOUT_S, description="Seconds one tool call may take; a "
                                  "call past it gets an error turn and counts in agent/tool_timeouts.")
    max_concurrent_tools: int = Field(32, ge=1, le=MAX_WORKERS,
                                      description="Tool calls running at once, over all episodes.")
    interactions: list[str] = Field(default_factory=list, description="Interaction plugins (a simulated user "
                                    "that answers each model turn without a tool call; interactions.NAME.* are "
                                    "their options); a data row's extra_info.interaction_kwargs.name picks one, "
                                    "the only one on where a row names none (verl: "
                                    "multi_turn.interaction_config_path).")

    @field_validator("tools", "interactions", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v


class TrainerConfig(_Section):
    total_epochs: int = Field(1, gt=0, le=MAX_STEPS, description="Passes over the training data.")
    total_steps: int | None = Field(None, gt=0, le=MAX_STEPS,
                                    description="Stop after this many steps (overrides epochs).")
    save_freq: int = Field(-1, ge=-1, le=MAX_STEPS,
                           description="Save a checkpoint every N steps (-1: only at the end, 0: never).")
    test_freq: int = Field(-1, ge=-1, le=MAX_STEPS, description="Validate every N steps (-1 or 0: never).")
    val_before_train: bool = Field(False, description="Validate once before the first step.")
    output_dir: str = Field("outputs/{project}/{experiment}", description="Run folder ({project}, "
                            "{experiment} are filled in; write a literal brace as {{ or }}).")
    project: str = Field("rlx", description="Project name (loggers; a folder name in output_dir).")
    experiment: str = Field("run", description="Experiment name (loggers; a folder name in output_dir). "
                            "{algorithm} in it is replaced by algorithm.name (the tiny preset: tiny-{algorithm}).")
    seed: int = Field(42, ge=0, le=MAX_SEED, description="Seed for data order, sampling and initialisation.")
    max_staleness: int = Field(
        0, ge=0, le=MAX_STALENESS, description="Asynchronous RL: how many policy versions a step's rollouts may lag "
        "behind the policy that trains on them. 0: the synchronous loop (generate, then train). 1: one-step "
        "off-policy, the rollouts of step k+1 are generated while step k trains. K > 1: weights reach the engine "
        f"only when the lag would exceed K (at most {MAX_STALENESS}). docs/rollout.md has the schedule.")
    resume: Literal["auto", "never", "must"] = Field(
        "auto", description="auto: continue from the last complete checkpoint in output_dir if any.")
    max_checkpoints_to_keep: int | None = Field(None, gt=0, le=MAX_STEPS, description="Delete older checkpoints.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the single-process run goes.")
    loggers: list[str] = Field(default_factory=lambda: ["console", "jsonl"], description="Logger plugins.")
    log_samples: int = Field(2, ge=0, le=MAX_BATCH, description="Sample rows given to loggers each step.")
    save_hf_model: bool = Field(True, description="Also write the final model in Hugging Face format.")
    private_run_dir: bool = Field(True, description="Create a new run folder readable by its owner only (0700): "
                                  "it holds configs, samples, checkpoints and models. An existing folder is left as "
                                  "it is.")

    @field_validator("loggers", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v

    @field_validator("project", "experiment")
    @classmethod
    def _folder_name(cls, v: str) -> str:
        # Each name is one folder inside output_dir: it must not climb out of it or hide in it.
        if not v:
            raise ValueError("must not be empty")
        if "/" in v or "\\" in v:
            raise ValueError("must be one folder name, without '/' or '\\'")
        if set(v) == {"."}:
            raise ValueError("must not be made only of dots: '.' and '..' name the same or the parent folder")
        if not v.isprintable():
            raise ValueError("must not contain control characters")
        return v

    @field_validator("output_dir")
    @classmethod
    def _output_dir(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        if not v.isprintable():
            raise ValueError("must not contain control characters")
        names = ", ".join("{" + p + "}" for p in OUTPUT_DIR_PLACEHOLDERS)
        try:
            fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(v) if name is not None]
        except ValueError as exc:
            raise ValueError(f"{exc}; the placeholders are {names}, and a literal brace is written {{{{ or }}}}"
                             ) from None
        for name, spec, conv in fields:
            if name not in OUTPUT_DIR_PLACEHOLDERS or spec or conv:
                raise ValueError(f"unknown placeholder {{{name}{'!' + conv if conv else ''}"
                                 f"{':' + spec if spec else ''}}}; the placeholders are {names}, and a "
                                 "literal brace is written {{ or }}")
        return v


class RLXConfig(_Section):
    """The whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    loggers: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-logger options, e.g. loggers.swanlab.mode=offline.")
    tools: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-tool options, e.g. tools.python.memory_mb=512 (agent.tools "
        "picks the tools).")
    interactions: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-interaction options (agent.interactions turns them on).")

    @model_validator(mode="after")
    def _cross_checks(self) -> RLXConfig:
        if "{algorithm}" in self.trainer.experiment:  # one run folder per algorithm (the tiny preset)
            self.trainer.experiment = self.trainer.experiment.replace("{algorithm}", self.algorithm.name)
        problems = []
        if self.data.train_batch_size % self.actor.ppo_mini_batch_size:
            problems.append(
                f"actor.ppo_mini_batch_size: {self.actor.ppo_mini_batch_size} must divide "
                f"data.train_batch_size ({self.data.train_batch_size}).")
        longest = self.data.max_prompt_length + self.data.max_response_length
        budgets = []
        if self.actor.use_dynamic_bsz:
            budgets += [("actor", "ppo_max_token_len_per_gpu", self.actor.ppo_max_token_len_per_gpu),
                        ("actor", "log_prob_max_token_len_per_gpu", self.actor.log_prob_max_token_len_per_gpu)]
        if self.critic.use_dynamic_bsz:
            budgets += [("critic", "ppo_max_token_len_per_gpu", self.critic.ppo_max_token_len_per_gpu),
                        ("critic", "forward_max_token_len_per_gpu", self.critic.forward_max_token_len_per_gpu)]
        for section, name, budget in budgets:
            if budget < longest:
                problems.append(
                    f"{section}.{name}: {budget} is smaller than the longest sequence, data.max_prompt_length + "
                    f"data.max_response_length = {longest}: raise it to at least {longest}, or set "
                    f"{section}.use_dynamic_bsz=false.")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def run_dir(self) -> Path:
        t = self.trainer
        return Path(os.path.expanduser(t.output_dir.format(project=t.project, experiment=t.experiment)))


def resolve_dtype(name: str, device: str) -> str:
    """The dtype that ``model.dtype`` (``name``) means on ``device`` (``cpu``, ``cuda``, ``cuda:1``, ...).

    ``auto`` is float32 on a CPU, where bfloat16 is slow and its rounding makes the policy and the
    reference disagree before any update, and bfloat16 on an accelerator. Other names pass through.
    """
    if name != "auto":
        return name
    kind = str(device).split(":", 1)[0]
    if kind == "auto":
        raise ValueError("resolve_dtype needs the device the model is placed on, not 'auto'")
    return "float32" if kind == "cpu" else "bfloat16"


# ---------------------------------------------------------------------------------------------
# Sources
SHORTCUTS = {
    "backend": "backend.name",
    "rollout": "rollout.name",
    "algorithm": "algorithm.name",
    "reward": "reward.name",
    "model": "model.path",
    "launcher": "launcher.name",
    "nproc": "launcher.nproc",
}


def override_key(text: str) -> str:
    """The dotted key of an override (``+a.b=1`` -> ``a.b``); ``""`` if it has no ``=``."""
    key, eq, _ = text.partition("=")
    return key.strip().lstrip("+") if eq else ""


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` -> (``"a.b"``, parsed value). Values are read as YAML (numbers, lists, true)."""
    if "=" not in text:
        raise ConfigError([f"override {text!r}: expected KEY=VALUE, e.g. actor.optim.lr=1e-6"])
    raw = text.partition("=")[2]
    key = override_key(text)
    if not key:
        raise ConfigError([f"override {text!r}: the key before '=' is empty"])
    if any(not part for part in key.split(".")):
        raise ConfigError([f"override {text!r}: the key {key!r} has an empty part; "
                           f"write dotted keys like actor.optim.lr"])
    if raw.strip()[:1] in ("[", "{"):  # meant as a list or mapping: it must parse
        try:
            yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError([f"{key}: value {raw.strip()!r} is not a valid YAML list or mapping "
                               f"({getattr(exc, 'problem', None) or exc}), e.g. {key}=[a,b]"]) from None
    return key, parse_value(raw)


def parse_value(raw: str) -> Any:
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw
    if isinstance(value, str) and raw.strip()[:1] not in ("'", '"'):  # YAML 1.1 reads 1e-6 as a string
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def takes_text(annotation: Any) -> bool:
    """Whether a field of this type holds text and nothing else: ``str``, a path, a ``Literal`` of strings,
    or one of those or None. Such a field gets an override's value as typed, not as YAML reads it."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return takes_text(get_args(annotation)[0])
    if origin is Literal:
        return all(isinstance(a, str) for a in get_args(annotation))
    if origin is Union or origin is types.UnionType:
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        return bool(kinds) and all(takes_text(a) for a in kinds)
    return isinstance(annotation, type) and issubclass(annotation, str | PurePath)


def _as_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (``Model`` or ``Model | None``), else None."""
    if get_origin(annotation) is Union or get_origin(annotation) is types.UnionType:
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        annotation = kinds[0] if len(kinds) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _field_takes_text(model: type[BaseModel] | None, parts: Sequence[str]) -> bool:
    for i, part in enumerate(parts):
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return False
        if i == len(parts) - 1:
            return takes_text(field.annotation)
        model = _as_model(field.annotation)
    return False


def _plugin_options_model(pm: Any, kind: str, name: Any) -> type[BaseModel] | None:
    """The options model of the component ``kind``/``name``; None when there is none or it cannot be
    loaded (validation reports that)."""
    if not isinstance(name, str):
        return None
    try:
        if pm is None:
            from rlx.registry import get_plugin_manager

            pm = get_plugin_manager()
        model = pm.get(kind, name).load_config_model()
    except Exception:
        return None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def override_takes_text(schema: type[BaseModel], raw: dict[str, Any], key: str, pm: Any = None) -> bool:
    """Whether the option ``key`` (dotted) holds text: a field of ``schema`` (the core config), of the
    options of the plugin a section names (``reward.pattern``: the reward ``raw`` names, or the section's
    default), or of a logger's options (``loggers.wandb.project``). ``pm``: the plugin manager (None: the
    process-wide one, asked only for a plugin's option)."""
    section, _, rest = key.partition(".")
    field = schema.model_fields.get(section)
    if field is None or not rest:
        return False
    parts = rest.split(".")
    model = _as_model(field.annotation)
    given = raw.get(section)
    if model is not None and issubclass(model, ComponentSection) and parts[0] not in model.model_fields:
        default = field.get_default(call_default_factory=True)
        name = given.get("name", default.name) if isinstance(given, dict) else default.name
        kind = "agent_loop" if section == "agent" else section
        return _field_takes_text(_plugin_options_model(pm, kind, name), parts)
    if model is None and section in ("loggers", "tools", "interactions") and len(parts) > 1:
        return _field_takes_text(_plugin_options_model(pm, section[:-1], parts[0]), parts[1:])
    return _field_takes_text(model, parts)


def _read_as_other_than_text(value: Any) -> bool:
    """YAML read the text as a number, a boolean or a date (``010`` as 8, ``no`` as False)."""
    return isinstance(value, bool | int | float | datetime.date)


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        raise ConfigError([f"--config {path}: is a folder, not a YAML file"])
    if not p.is_file():
        raise ConfigError([f"--config {path}: no such file"])
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"--config {path}: cannot read the file: {exc}"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"--config {path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: the top level must be a mapping of sections, "
                           f"got {type(data).__name__}"])
    # An empty section (``trainer:`` with nothing under it) sets nothing.
    return {k: v for k, v in data.items() if v is not None}


# Presets of the reward-model trainer (`rlx rm train`) are named rm_*; the others are `rlx train`'s.
PRESET_COMMANDS = {"train": "rlx train", "rm": "rlx rm train"}


def _preset_family(stem: str) -> str:
    return "rm" if stem.startswith("rm_") else "train"


def preset_names(family: str = "train") -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml") if _preset_family(p.stem) == family)


def load_preset(name: str, family: str = "train") -> dict[str, Any]:
    path = PRESET_DIR / f"{name}.yaml"
    names = preset_names(family)
    if path.is_file() and _preset_family(name) != family:
        raise ConfigError([f"--preset {name} is a preset of `{PRESET_COMMANDS[_preset_family(name)]}`, not of "
                           f"`{PRESET_COMMANDS[family]}`. Presets of `{PRESET_COMMANDS[family]}`: {', '.join(names)}"])
    if not path.is_file():
        raise ConfigError([f"--preset {name}: no such preset.{did_you_mean(name, names)} "
                           f"Presets: {', '.join(names)}"])
    return yaml.safe_load(path.read_text()) or {}


def build_raw(
    *,
    preset: str | None = None,
    config_file: str | Sequence[str] | None = None,
    shortcuts: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    preset_family: str = "train",
    pm: Any = None,
    schema: type[BaseModel] | None = None,
) -> dict[str, Any]:
    """Merge every source into one plain dict (not yet validated).

    ``config_file`` may be several files: they are merged in order, a later file's keys over an earlier's.
    ``preset_family`` is the command whose presets ``preset`` names (``train`` or ``rm``); ``schema`` the config
    model the result is for (:class:`RLXConfig` unless given; ``rlx rm`` gives its own).

    An override's value is read as YAML (numbers, lists, true), except where the option it sets holds text
    (:func:`override_takes_text`; ``pm`` finds the plugins' options): there a value YAML would read as a
    number, boolean or date is kept as typed (``trainer.experiment=010`` is ``"010"``, not 8).
    """
    raw: dict[str, Any] = {}
    if preset:
        raw = deep_merge(raw, load_preset(preset, preset_family))
    files = [config_file] if isinstance(config_file, str) else list(config_file or [])
    problems: list[str] = []
    for path in files:
        try:
            raw = deep_merge(raw, load_yaml(path))
        except ConfigError as exc:
            problems.extend(exc.problems)
    for flag, value in (shortcuts or {}).items():
        if value is not None:
            set_dotted(raw, SHORTCUTS[flag], value)
    applied: list[tuple[str, str, Any]] = []
    for text in overrides or []:
        try:
            key, value = parse_override(text)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        set_dotted(raw, key, value)
        applied.append((key, text.partition("=")[2].strip(), value))
    # Once every source is in (the plugin a section names may come last), text options get their text.
    schema = schema or RLXConfig
    for key, text, value in applied:
        if (_read_as_other_than_text(value) and get_dotted(raw, key) is value
                and override_takes_text(schema, raw, key, pm)):
            set_dotted(raw, key, text)
    if problems:
        raise ConfigError(problems)
    return raw


def get_dotted(tree: dict[str, Any], key: str) -> Any:
    """The value at ``a.b.c`` in nested dicts; None where a part is missing."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


# ---------------------------------------------------------------------------------------------
# Validation
def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the (sub)model at ``loc``, for did-you-mean suggestions."""
    if not loc:
        return list(model.model_fields)
    field = _field_at(model, loc)
    sub = _as_model(field.annotation) if field is not None else None
    return list(sub.model_fields) if sub is not None else []


def _field_at(model: type[BaseModel], loc: tuple[Any, ...]) -> Any:
    """The pydantic ``FieldInfo`` at ``loc`` inside ``model`` (submodels followed), or None."""
    current: Any = model
    field = None
    for part in loc:
        current = _as_model(field.annotation) if field is not None else current
        if current is None:
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
    return field


def _missing_hint(model: type[BaseModel], loc: tuple[Any, ...], path: str) -> str:
    """What a required key that was not given is for, and how to give it (``reward.path`` of the custom
    reward: its description and ``set reward.path=...``)."""
    field = _field_at(model, loc)
    description = (field.description or "").strip() if field is not None else ""
    how = f"set {path}=..." if "[" not in path else "give it"
    return f": {how}" + (f" ({description})" if description else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def dotted_path(parts: list[Any] | tuple[Any, ...]) -> str:
    """``("trainer", "loggers", 1)`` -> ``trainer.loggers[1]``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def format_validation_error(exc: ValidationError, model: type[BaseModel], prefix: str = "",
                            owner: str = "", extra_keys: Sequence[str] = ()) -> list[str]:
    """One line per pydantic error: ``dotted.path: what is wrong (got VALUE)``.

    ``prefix`` is the dotted path of ``model`` in the whole config (``algorithm`` for a plugin's options).
    A plugin's options share their section with core keys: ``owner`` names the plugin and
    ``extra_keys`` are the section's core keys, offered too when a top-level key is unknown.
    """
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = dotted_path((prefix.split(".") if prefix else []) + list(loc)) or "(top level)"
        kind = err["type"]
        if kind == "extra_forbidden":
            names = _fields_at(model, loc[:-1])
            whose = ""
            if len(loc) == 1 and owner:
                names, whose = names + list(extra_keys), f" for {owner}"
            problems.append(f"{path}: unknown key{whose}.{did_you_mean(str(loc[-1]), names)} "
                            f"Valid keys here: {', '.join(names)}")
            continue
        msg = err["msg"]
        if kind == "missing" and loc and isinstance(loc[-1], int):  # a tuple given too few items
            path = dotted_path((prefix.split(".") if prefix else []) + list(loc[:-1]))
            msg = f"too few items: item [{loc[-1]}] is missing"
        elif kind == "literal_error":
            msg = "must be one of " + err.get("ctx", {}).get("expected", "")
        elif kind == "value_error":
            msg = msg.removeprefix("Value error, ")
            if not loc:  # cross-field check: the core's messages carry their own path
                problems.extend(f"{prefix}: {m.strip()}" if prefix else m.strip() for m in msg.split("; "))
                continue
        elif kind == "missing" and loc:
            msg += _missing_hint(model, loc, path)
        if "input" in err and (kind != "missing" or (loc and isinstance(loc[-1], int))):
            got = _short(err["input"])
            quoted = kind == "value_error" and isinstance(err["input"], str) and got in msg
            if not quoted:  # a validator's own message that quotes the text given already says it
                msg += f" (got {got})"
        problems.append(f"{path}: {msg}")
    return problems


def validate(raw: dict[str, Any]) -> RLXConfig:
    """Validate the core sections. Raises :class:`ConfigError` listing every problem."""
    try:
        return RLXConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, RLXConfig)) from None
