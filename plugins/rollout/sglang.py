"""The ``sglang`` rollout engine: SGLang in the worker process (``pip install 'rlx[sglang]'``), or a running SGLang
server reached over HTTP (``rollout.server_url``, for rollout on other machines; no local sglang needed).

Written against SGLang 0.5's API (``sglang.Engine`` and the server's native endpoints):

- **sampling** (``Engine.generate`` / ``POST /generate`` with ``input_ids``, one sampling-params dict per row and
  ``return_logprob``): each prompt is sent ``n`` times with ``n=1`` (rows come back in order, and SGLang's radix
  cache shares the prompt's KV cache between them); the stop set is exactly the tokenizer's EOS plus
  ``stop_token_ids`` (``ignore_eos`` with the EOS ids among the stop ids); ``sampling_seed`` gives each row its
  own seed, which SGLang honours with ``enable_deterministic_inference``. The log-prob of each sampled token is
  SGLang's ``output_token_logprobs``: ``log_softmax(logits / temperature)``, taken *before* top-k and top-p
  filtering (unlike vLLM and ``hf``, which report the filtered distribution); it equals the trainer's
  ``old_log_probs`` definition, so with top-k/top-p on, ``rollout/logprob_diff_*`` measures the engines alone.
  Leave ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset: it switches SGLang to the log-probs before temperature.
- **weights**: in-process, ``Engine.update_weights_from_tensor`` bucket by bucket (``flush_cache`` once at the
  end); with a server, each bucket is written as a safetensors shard to ``weights_dir`` (a folder the server can
  read) and ``POST /update_weights_from_disk`` loads the folder.
- **memory**: ``release_memory_occupation`` / ``resume_memory_occupation`` (``enable_memory_saver``) around
  training; a server is only put to sleep when ``sleep_server`` says it shares the training GPUs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from collections.abc import Iterable
from pathlib import Path
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

INSTALL = "pip install 'rlx[sglang]'"
# sglang ServerArgs fields rlx sets itself.
RLX_OWNED = ("model_path", "tokenizer_path", "skip_tokenizer_init", "random_seed", "trust_remote_code", "dtype",
             "mem_fraction_static", "tp_size", "enable_memory_saver", "disable_cuda_graph", "context_length",
             "enable_deterministic_inference")


class SGLangRolloutOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    server_url: str | None = Field(
        None, description="Use a running SGLang server (http://host:port) instead of an engine in the worker "
        "process: rollout on other machines; weights travel through weights_dir.")
    weights_dir: str | None = Field(
        None, description="Server mode: a folder the server can read, where each weight update is written as "
        "safetensors shards for POST /update_weights_from_disk.")
    sleep_server: bool = Field(False, description="Server mode: release the server's memory while training runs "
                               "(only for a server on the training GPUs).")
    request_timeout_s: float = Field(600.0, gt=0, le=7 * 86400, description="Server mode: most seconds per request.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype for generation (auto: float32 on CPU, bfloat16 on GPU).")
    mem_fraction_static: float = Field(
        0.5, gt=0, le=1, description="Share of the GPU's memory SGLang takes for weights and KV cache.")
    tp_size: int = Field(1, ge=1, le=1024, description="GPUs one engine shards the model over.")
    enable_memory_saver: bool | None = Field(
        None, description="Free the engine's memory while training runs (release/resume memory occupation; null: "
        "on when a GPU is used).")
    disable_cuda_graph: bool = Field(False, description="No CUDA graphs: slower decoding, faster start.")
    context_length: int | None = Field(
        None, gt=0, le=2**24, description="Longest prompt + response (null: data.max_prompt_length + "
        "data.max_response_length).")
    enable_deterministic_inference: bool = Field(
        False, description="Deterministic kernels; needed for SamplingParams.seed to give repeatable samples.")
    weight_bucket_mb: float = Field(256.0, gt=0, le=2**20,
                                    description="Weights are sent to the engine in calls of at most this size.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Other sglang ServerArgs fields, passed as they are (engine mode; checked "
        "against the installed SGLang).")

    def plugin_problems(self, pm: PluginManager | None) -> list[str]:
        """Problems only the installed SGLang and the machine can tell (called by config validation)."""
        if self.server_url is not None:
            problems = []
            if not self.server_url.startswith(("http://", "https://")):
                problems.append(f"server_url: {self.server_url!r} is not an http:// or https:// address.")
            if not self.weights_dir:
                problems.append("weights_dir: server mode needs a folder the server can read, to load new weights "
                                "from (set rollout.weights_dir=PATH).")
            if self.engine_kwargs:
                problems.append("engine_kwargs: server mode starts no engine; pass these to the server instead.")
            return problems
        if importlib.util.find_spec("sglang") is None:
            return [f"name: the sglang rollout engine needs the Python package `sglang`, which is not installed. "
                    f"Install it with: {INSTALL} (or use a running server: rollout.server_url=http://HOST:PORT)"]
        known, version = server_arg_fields()
        problems = []
        for key in self.engine_kwargs:
            if key in RLX_OWNED:
                problems.append(f"engine_kwargs.{key}: set by rlx.")
            elif key not in known:
                problems.append(f"engine_kwargs.{key}: the installed SGLang {version} has no server argument {key!r}."
                                f"{did_you_mean(key, sorted(known))}")
        devices = visible_devices()
        if self.tp_size > max(devices, 1):
            problems.append(f"tp_size: {self.tp_size} is more than the {devices} GPU(s) this machine has.")
        return problems


def server_arg_fields() -> tuple[set[str], str]:
    """The names of the installed SGLang's ``ServerArgs`` fields, and its version."""
    import sglang
    from sglang.srt.server_args import ServerArgs

    return {f.name for f in dataclasses.fields(ServerArgs)}, str(getattr(sglang, "__version__", "?"))


def visible_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _row_seed(seed: int, row: int) -> int:
    """A distinct, repeatable seed per row; another ``seed`` lands far away."""
    return (seed * 1_000_003 + row) % (2**31 - 1)


def _check(result: Any, what: str) -> None:
    """SGLang answers weight and memory calls with ``(success, message)`` or a dict with ``success``."""
    ok, message = True, ""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        ok, message = result[0], str(result[1]) if len(result) > 1 else ""
    elif isinstance(result, dict) and "success" in result:
        ok, message = bool(result["success"]), str(result.get("message", ""))
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")


class _Server:
    """The native HTTP endpoints of a running SGLang server."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def request(self, path: str, body: Any = None) -> Any:
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"SGLang server {self.url}{path}: HTTP {exc.code}: {exc.read().decode()[:500]}") from exc
        return json.loads(text) if text.strip() else None

    def check_reachable(self) -> None:
        import urllib.error

        try:
            self.request("/health")
        except (urllib.error.URLError, OSError, RuntimeError) as exc:
            raise UserError(f"Cannot reach the SGLang server at {self.url} ({exc}).",
                            "Start it (python -m sglang.launch_server --model-path MODEL --port PORT) or fix "
                            "rollout.server_url.") from None


class SGLangRollout:
    def __init__(self, model_path: str, options: SGLangRolloutOptions, *, eos_token_ids: list[int],
                 pad_token_id: int, seed: int, context_length: int | None, trust_remote_code: bool = False,
                 config_overrides: dict[str, Any] | None = None) -> None:
        import torch

        from rlx.config import resolve_dtype

        self.options = options
        self.model_path = model_path
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.weight_version = 0
        self.server: _Server | None = None
        self.engine: Any = None
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if options.server_url is not None:
            self.server = _Server(options.server_url, options.request_timeout_s)
            self.server.check_reachable()
            self.memory_saver = options.sleep_server
            return
        from rlx.errors import require

        sglang = require("sglang", "sglang", "The sglang rollout engine")
        self.memory_saver = (options.enable_memory_saver if options.enable_memory_saver is not None
                             else device == "cuda")
        kwargs: dict[str, Any] = {
            "model_path": model_path, "skip_tokenizer_init": True, "random_seed": seed,
            "trust_remote_code": trust_remote_code, "dtype": resolve_dtype(options.dtype, device),
            "mem_fraction_static": options.mem_fraction_static, "tp_size": options.tp_size,
            "enable_memory_saver": self.memory_saver, "disable_cuda_graph": options.disable_cuda_graph,
            "enable_deterministic_inference": options.enable_deterministic_inference,
        }
        if options.context_length or context_length:
            kwargs["context_length"] = options.context_length or context_length
        if config_overrides:  # model.override_config, set on the Hugging Face config SGLang reads
            kwargs["json_model_override_args"] = json.dumps(config_overrides)
        kwargs.update(options.engine_kwargs)
        self.engine = sglang.Engine(**kwargs)

    # -- generation ---------------------------------------------------------------------------------------
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        import torch

        from rlx.batch import Batch
        from rlx.run.vision import engine_prompts, image_token_id

        stop = list(dict.fromkeys([*self.eos_token_ids, *params.stop_token_ids]))
        greedy = params.greedy or params.temperature == 0
        ids = [row[m.bool()].tolist() for row, m in zip(prompts["input_ids"], prompts["attention_mask"])]
        # A vision-language model's rows with images: their images, one image token per image (SGLang repeats it).
        pairs = [pair for pair in engine_prompts(prompts, ids, image_token_id(self.model_path))
                 for _ in range(params.n)]
        rows_in = [x for x, _ in pairs]
        images = [im for _, im in pairs]
        sampling = []
        for row in range(len(rows_in)):
            sp: dict[str, Any] = {
                "n": 1, "temperature": 0.0 if greedy else params.temperature, "top_p": 1.0 if greedy else params.top_p,
                "top_k": -1 if greedy or params.top_k <= 0 else params.top_k, "max_new_tokens": params.max_tokens,
                "stop_token_ids": stop, "ignore_eos": True}
            if params.seed is not None:
                sp["sampling_seed"] = _row_seed(params.seed, row)
            sampling.append(sp)
        outputs = self._generate(rows_in, sampling, images if any(im is not None for im in images) else None)
        rows: list[list[int]] = []
        row_log_probs: list[list[float]] = []
        for out in outputs:
            entries = out["meta_info"]["output_token_logprobs"][:params.max_tokens]  # (logprob, token id, text)
            tokens = [int(e[1]) for e in entries]
            end = next((k + 1 for k, t in enumerate(tokens) if t in stop), len(tokens))
            rows.append(tokens[:end])
            row_log_probs.append([float(e[0]) for e in entries[:end]])
        width = max(1, max(len(r) for r in rows))
        responses = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        log_probs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (tokens, lps) in enumerate(zip(rows, row_log_probs)):
            if tokens:
                responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                mask[i, :len(tokens)] = 1
                log_probs[i, :len(tokens)] = torch.tensor(lps, dtype=torch.float32)
        repeated = prompts.repeat_interleave(params.n)
        batch = Batch({"prompts": repeated["input_ids"], "prompt_mask": repeated["attention_mask"],
                       "responses": responses, "response_mask": mask, "rollout_log_probs": log_probs},
                      dict(repeated.non_tensors))
        return batch

    def _generate(self, input_ids: list[list[int]], sampling: list[dict[str, Any]],
                  images: list[Any] | None = None) -> list[dict[str, Any]]:
        extra: dict[str, Any] = {}
        if images is not None:  # per row: its PIL images, or None
            if self.server is not None:
                raise UserError("The sglang engine reached over HTTP (rollout.server_url) takes no images from rlx.",
                                "Run the sglang engine in process for a vision-language model, or use rollout=vllm.")
            extra["image_data"] = images
        if self.server is not None:
            out = self.server.request("/generate", {"input_ids": input_ids, "sampling_params": sampling,
                                                    "return_logprob": True})
        else:
            out = self.engine.generate(input_ids=input_ids, sampling_params=sampling, return_logprob=True, **extra)
        return out if isinstance(out, list) else [out]

    # -- weights ------------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        limit = max(1, int(self.options.weight_bucket_mb * 2**20))
        send = self._write_shard if self.server is not None else self._send_bucket
        bucket: list[tuple[str, torch.Tensor]] = []
        size = index = 0
        names: dict[str, str] = {}
        if self.server is not None:
            self._prepare_weights_dir()
        for name, tensor in named_tensors:
            bucket.append((name, tensor.detach()))
            size += tensor.numel() * tensor.element_size()
            if size >= limit:
                names.update(send(bucket, index))
                bucket, size, index = [], 0, index + 1
        if bucket:
            names.update(send(bucket, index))
        if self.server is not None:
            self._finish_weights_dir(names)
            _check(self.server.request("/update_weights_from_disk", {"model_path": str(self._weights_path())}),
                   "update_weights_from_disk")
        else:
            self.engine.flush_cache()
        self.weight_version += 1

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], index: int) -> dict[str, str]:
        _check(self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False),
               "update_weights_from_tensor")
        return {}

    def _weights_path(self) -> Path:
        assert self.options.weights_dir is not None
        return Path(self.options.weights_dir).expanduser() / "rlx_weights"

    def _prepare_weights_dir(self) -> None:
        """An empty folder with the model's config and tokenizer files (everything but its weights)."""
        folder = self._weights_path()
        if folder.is_symlink():
            raise UserError(f"{folder} is a symbolic link; rlx writes weights only into a real folder.")
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        for item in Path(self.model_path).iterdir():
            if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".pt", ".safetensors.index.json")):
                shutil.copy2(item, folder / item.name)

    def _write_shard(self, bucket: list[tuple[str, torch.Tensor]], index: int) -> dict[str, str]:
        from safetensors.torch import save_file

        name = f"model-rlx-{index:05d}.safetensors"
        save_file({n: t.to("cpu").contiguous() for n, t in bucket}, str(self._weights_path() / name))
        return {n: name for n, _ in bucket}

    def _finish_weights_dir(self, weight_map: dict[str, str]) -> None:
        (self._weights_path() / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))

    # -- memory -------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        if not self.memory_saver:
            return
        if self.server is not None:
            _check(self.server.request("/release_memory_occupation", {}), "release_memory_occupation")
        else:
            _check(self.engine.release_memory_occupation(), "release_memory_occupation")

    def wake_up(self) -> None:
        if not self.memory_saver:
            return
        if self.server is not None:
            _check(self.server.request("/resume_memory_occupation", {}), "resume_memory_occupation")
        else:
            _check(self.engine.resume_memory_occupation(), "resume_memory_occupation")

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()


def engine_arguments(options: SGLangRolloutOptions, ctx: BuildContext) -> dict[str, Any]:
    """The keyword arguments of :class:`SGLangRollout` for the engine ``ctx`` describes. Each engine of a
    pool samples with its own seed, ``trainer.seed`` plus its rank in the pool (``ctx.rank``, given by the
    launcher that builds the pool): with one seed, N engines would draw the same responses to a prompt."""
    from rlx.run.data import resolve_path

    cfg = ctx.config
    assert cfg is not None and ctx.tokenizer is not None
    tok = ctx.tokenizer
    eos = tok.eos_token_id
    return {"model_path": resolve_path(cfg.model.path), "options": options,
            "eos_token_ids": [eos] if isinstance(eos, int) else list(eos), "pad_token_id": tok.pad_token_id,
            "seed": cfg.trainer.seed + ctx.rank, "trust_remote_code": cfg.model.trust_remote_code,
            "context_length": cfg.data.max_prompt_length + cfg.data.max_response_length,
            "config_overrides": dict(cfg.model.override_config)}


def build(options: SGLangRolloutOptions | None, ctx: BuildContext) -> SGLangRollout:
    options = options or SGLangRolloutOptions()
    problems = options.plugin_problems(None)
    if ctx.config is not None and ctx.config.model.override_config:
        if options.server_url is not None:
            problems.append("server_url: a running server has loaded its model already, so model.override_config "
                            "cannot reach it; start the server with --json-model-override-args, or leave out "
                            "model.override_config")
        elif "json_model_override_args" in options.engine_kwargs:
            problems.append("engine_kwargs.json_model_override_args: give the config's overrides once, in "
                            "model.override_config (rlx passes them to SGLang as json_model_override_args)")
    if problems:
        raise UserError("The sglang rollout engine cannot start: " + "; ".join(f"rollout.{p}" for p in problems))
    return SGLangRollout(**engine_arguments(options, ctx))


@hookimpl
def rlx_rollout_engines() -> list[Component]:
    return [Component(kind="rollout", name="sglang", factory=build, config_model=SGLangRolloutOptions,
                      summary="SGLang in the worker process, or a running SGLang server (pip install 'rlx[sglang]').",
                      extra={"requires": [Requirement("sglang", "sglang", "pip install 'rlx[sglang]'",
                                                      unless="server_url")]})]
