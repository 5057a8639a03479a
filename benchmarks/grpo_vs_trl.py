"""One GRPO step of rlx against TRL's ``GRPOTrainer``, side by side in one process on one GPU (issue 9).

The work: a model of Qwen2.5-0.5B's shape and vocabulary (24 layers, hidden 896, 14 heads, 2 KV heads,
151,936 tokens) with random bf16 weights, 8 prompts of 214 tokens x 8 samples = 64 responses of 256 tokens,
one optimizer step per batch of rollouts, no KL term (TRL's default beta=0). The tokenizer is a word-level
one with the same vocabulary size (no download), so both frameworks see the same token counts. Random
weights rarely produce the end token, so every response runs to 256 tokens.

    pip install trl                     # TRL and its dependencies (datasets)
    python benchmarks/grpo_vs_trl.py OUT_DIR [--steps 5] [--parts gen,rlx,trl] [rlx dotted overrides...]
    python benchmarks/grpo_vs_trl.py OUT_DIR --smoke    # CPU, seconds: a 2-layer model, 4 prompts x 2 samples (CI)

``--smoke`` runs the same code (rlx's trainer and engine, and TRL's trainer when ``trl`` is importable) on
the CPU in float32 with a 2-layer model of width 64 and a vocabulary of 512 (in OUT_DIR/smoke_model), 4
prompts of 16 tokens x 2 samples of 8 tokens, 2 steps, every part; it fails (exit 1) if a part failed or a
sampled token's log-prob differs from the training forward pass's by 1e-3 or more. Its times say nothing
about the GPU run.

Prints, from one run: each framework's seconds per step (mean of the steps after the first), their ratio,
rlx's stage breakdown (its timing/* metrics), the peak GPU memory of each, the time to generate the 64 x 256
tokens with rlx's engine (static cache + CUDA graph) against transformers' own static cache + torch.compile
``generate``, the agreement of the sampled tokens' log-probs with the training forward pass (fast and
plain decoders), and the time to load new weights into the engine. Everything printed is also written to
OUT_DIR/results.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from rlx import hookimpl

PROMPT_TOKENS, RESPONSE_TOKENS, PROMPTS, SAMPLES = 214, 256, 8, 8
VOCAB = 151_936
SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
         "num_key_value_heads": 2}
DEVICE = "cuda"
# --smoke: the sizes above and the device, for a CPU run of seconds
SMOKE_SIZES = {"PROMPT_TOKENS": 16, "RESPONSE_TOKENS": 8, "PROMPTS": 4, "SAMPLES": 2, "VOCAB": 512, "DEVICE": "cpu",
               "SHAPE": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2}}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
REWARD_FILE = '''
def compute_score(response):
    """Any cheap score that differs between responses (the model has random weights)."""
    return (sum(map(ord, response)) % 97) / 97.0
'''
RESULTS: dict[str, Any] = {}


def record(key: str, value: Any) -> None:
    RESULTS[key] = value
    print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}", flush=True)


def build_model(path: Path, tokenizer_path: Path) -> None:
    """A Qwen2.5-0.5B-shaped model with random weights, and a word-level tokenizer of the same vocabulary in
    a folder of its own (next to a Qwen2 config, AutoTokenizer would load it as Qwen2's byte-level BPE)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = {f"w{i}": i for i in range(VOCAB - 2)}
    words.update({"<|pad|>": VOCAB - 2, "<|end|>": VOCAB - 1})
    tok = Tokenizer(models.WordLevel(words, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(vocab_size=VOCAB, **SHAPE, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id,
                         bos_token_id=fast.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    fast.save_pretrained(tokenizer_path)


def prompt_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(VOCAB - 2)}" for _ in range(PROMPT_TOKENS)) for _ in range(count)]


def write_data(out: Path, texts: list[str]) -> Path:
    import pandas as pd

    rows = [{"prompt": [{"role": "user", "content": t}], "data_source": "bench",
             "reward_model": {"ground_truth": "0", "style": "rule"}, "extra_info": {"index": i}}
            for i, t in enumerate(texts)]
    path = out / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return path


def on_gpu() -> bool:
    return DEVICE.startswith("cuda")


def record_peak(key: str) -> None:
    """The peak GPU memory since the last ``fresh_peak`` (nothing on the CPU)."""
    import torch

    if on_gpu():
        record(key, torch.cuda.max_memory_allocated() / 2**30)


def fresh_peak() -> None:
    import torch

    gc.collect()
    if on_gpu():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def sync() -> None:
    import torch

    if on_gpu():
        torch.cuda.synchronize()


def timed(fn: Any) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def compute_dtype() -> str:
    """The dtype of the runs' forward passes: bf16 on a GPU, float32 on the CPU (the smoke run)."""
    return "bfloat16" if on_gpu() else "float32"


# -- generation -----------------------------------------------------------------------------------------
def prompt_batch(tok: Any, texts: list[str]) -> Any:
    from rlx.run.data import PromptExample, collate

    examples = []
    for i, t in enumerate(texts):
        ids = tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert len(ids) == PROMPT_TOKENS, len(ids)
        examples.append(PromptExample(list(ids), t, "bench", "0", {"index": i}))
    return collate(examples, tok.pad_token_id)


def profile(engine: Any, prompts: Any, params: Any, path: Path) -> None:
    """Where one 64 x 256 generate call spends its GPU time: the top kernels, from torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    path.write_text(table)
    print("\n".join(table.splitlines()[:20]), flush=True)


def bench_generation(model_dir: Path, tok_dir: Path, variants: list[str], profile_dir: Path | None) -> None:
    """rlx's engine (each compile mode, and the plain dynamic-cache loop) against transformers' static cache +
    torch.compile ``generate``, on the same 64 x 256 tokens; log-prob agreement with the training forward."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.plugins.modeling.head import response_log_probs
    from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions
    from rlx.protocols import SamplingParams

    tok = AutoTokenizer.from_pretrained(tok_dir)
    prompts = prompt_batch(tok, prompt_texts(PROMPTS, seed=1))
    params = SamplingParams(n=SAMPLES, max_tokens=RESPONSE_TOKENS)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, compute_dtype()))
    reference = reference.to(DEVICE).eval()

    def agreement(out: Any) -> float:
        with torch.no_grad():
            lp, _ = response_log_probs(reference, out.to(DEVICE), 1.0, with_entropy=False)
        mask = out["response_mask"].bool().to(DEVICE)
        return float((lp - out["rollout_log_probs"].to(DEVICE)).abs()[mask].mean())

    # decoder=static: what "auto" is on a GPU, named so that the CPU smoke run takes the same path
    engines = [("dynamic", {"decoder": "dynamic"}) if mode == "dynamic"
               else ("static", {"decoder": "static", "compile": mode}) for mode in variants]
    for name, options in engines:
        label = f"gen/rlx_{name}" + (f"_{options['compile']}" if "compile" in options else "")
        try:
            fresh_peak()
            engine = HFRollout(str(model_dir), HFRolloutOptions(micro_batch_size=512, **options), DEVICE,
                               [tok.eos_token_id], tok.pad_token_id)
            first = timed(lambda e=engine: e.generate(prompts, params))
            record(f"{label}/first_call_s", first)
            times = [timed(lambda e=engine: e.generate(prompts, params)) for _ in range(1 if name == "dynamic" else 3)]
            record(f"{label}/s", min(times))
            record(f"{label}/ms_per_token_step", 1000 * min(times) / RESPONSE_TOKENS)
            torch.manual_seed(3)
            out = engine.generate(prompts, params)
            record_peak(f"{label}/peak_gib")
            record(f"{label}/response_tokens", int(out["response_mask"].sum()))
            record(f"{label}/log_prob_abs_diff_vs_training_forward", agreement(out))
            if profile_dir is not None and options.get("compile") == "default":
                profile(engine, prompts, params, profile_dir / "decode_profile.txt")
            state = list(reference.state_dict().items())
            record(f"{label}/update_weights_s", timed(lambda e=engine, s=state: e.update_weights(s)))
            engine.close()
            del engine
        except Exception:
            traceback.print_exc()
            record(f"{label}/error", traceback.format_exc(limit=2).splitlines()[-1])

    # transformers' own path: static cache, the decode step compiled by generate itself
    try:
        fresh_peak()
        ids = prompts["input_ids"].repeat_interleave(SAMPLES, 0).to(DEVICE)
        mask = prompts["attention_mask"].repeat_interleave(SAMPLES, 0).to(DEVICE)
        kwargs = {"max_new_tokens": RESPONSE_TOKENS, "min_new_tokens": RESPONSE_TOKENS, "do_sample": True,
                  "cache_implementation": "static", "pad_token_id": tok.pad_token_id, "top_k": 0, "top_p": 1.0}
        with torch.no_grad():
            first = timed(lambda: reference.generate(input_ids=ids, attention_mask=mask, **kwargs))
            record("gen/transformers_static_compile/first_call_s", first)
            times = [timed(lambda: reference.generate(input_ids=ids, attention_mask=mask, **kwargs)) for _ in range(3)]
        record("gen/transformers_static_compile/s", min(times))
        record("gen/transformers_static_compile/ms_per_token_step", 1000 * min(times) / RESPONSE_TOKENS)
        record_peak("gen/transformers_static_compile/peak_gib")
    except Exception:
        traceback.print_exc()
        record("gen/transformers_static_compile/error", traceback.format_exc(limit=2).splitlines()[-1])


# -- GRPO steps -----------------------------------------------------------------------------------------
class StepProfiler:
    """A plugin that profiles the last training step (top kernels, the GPU's idle gaps with what the host ran
    meanwhile, and the memory held between steps)."""

    def __init__(self, steps: int, path: Path, name: str = "rlx") -> None:
        self.steps, self.path, self.name = steps, path, name
        self.prof: Any = None

    @hookimpl
    def rlx_on_step_end(self, step: int, metrics: Any) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if step == self.steps - 1:
            record(f"{self.name}/memory_between_steps_gib", torch.cuda.memory_allocated() / 2**30)
            census = held_tensors()
            print(census, flush=True)
            self.path.with_suffix(".held.txt").write_text(census + "\n")
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif step == self.steps and self.prof is not None:
            from actor_update import idle_report  # benchmarks/ is the script's folder, first on sys.path

            self.prof.__exit__(None, None, None)
            table = self.prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                                   max_name_column_width=70)
            report = f"{idle_report(self.prof.events())}\n{table}"
            self.path.write_text(report)
            print("\n".join(report.splitlines()[:40]), flush=True)


class PhaseMemory:
    """The peak GPU memory of each stage of rlx's steps (the trainer's ``timing/*`` stages, nested ones
    included), recorded as ``NAME/peak_gib/STAGE`` (the largest over the steps; ``NAME/peak_gib_first/STAGE``
    for the first step's, compilation included). It wraps ``rlx.trainer.Timer`` while installed."""

    def __init__(self, name: str) -> None:
        self.name, self.open, self.finished = name, [], 0  # finished: steps ended so far
        self.peaks: dict[str, float] = {}
        self.overall = 0.0  # the whole run's, between stages included

    def install(self) -> Any:
        from contextlib import contextmanager

        import torch

        from rlx import trainer

        original, tracker = trainer.Timer.__call__, self

        @contextmanager
        def timed_stage(timer: Any, stage: str) -> Any:
            tracker.note()
            tracker.open.append(stage)
            torch.cuda.reset_peak_memory_stats()
            try:
                with original(timer, stage):
                    yield
            finally:
                tracker.note()
                tracker.open.pop()

        trainer.Timer.__call__ = timed_stage
        return lambda: setattr(trainer.Timer, "__call__", original)

    def note(self) -> None:
        import torch

        peak = torch.cuda.max_memory_allocated() / 2**30
        self.overall = max(self.overall, peak)
        first = "_first" if self.finished == 0 else ""
        for stage in self.open:
            key = f"{self.name}/peak_gib{first}/{stage}"
            self.peaks[key] = max(self.peaks.get(key, 0.0), peak)

    @hookimpl
    def rlx_on_step_end(self, step: int, metrics: Any) -> None:
        self.finished = step


def held_tensors(top: int = 12) -> str:
    """The CUDA tensors alive now, by (shape, dtype): count and GiB (storages counted once), largest first."""
    import torch

    seen: set[int] = set()
    groups: dict[tuple[Any, ...], list[float]] = {}
    gc.collect()
    for obj in gc.get_objects():
        try:
            if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
                continue
            ptr = obj.untyped_storage().data_ptr()
        except Exception:
            continue
        if ptr in seen or ptr == 0:
            continue
        seen.add(ptr)
        key = (tuple(obj.shape), str(obj.dtype).replace("torch.", ""))
        entry = groups.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += obj.untyped_storage().nbytes() / 2**30
    total = sum(v[1] for v in groups.values())
    lines = [f"CUDA tensors reachable from Python: {total:.3f} GiB in {sum(v[0] for v in groups.values())} "
             f"storages (allocated: {torch.cuda.memory_allocated() / 2**30:.3f} GiB); largest groups:"]
    for (shape, dtype), (count, gib) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {gib:8.3f} GiB  {count:4d} x {dtype} {list(shape)}")
    return "\n".join(lines)


class HeldMemory:
    """A plugin that records the GPU memory still allocated at the end of each step (weights, optimizer
    states, the engine and its cache: what the next step starts from)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @hookimpl
    def rlx_on_step_end(self, step: int, metrics: Any) -> None:
        import torch

        if on_gpu():
            RESULTS[f"{self.name}/memory_between_steps_gib"] = torch.cuda.memory_allocated() / 2**30


def bench_rlx(out: Path, model_dir: Path, tok_dir: Path, data: Path, steps: int, extra: list[str],
              name: str = "rlx", profile_path: Path | None = None) -> None:
    from rlx.registry import get_plugin_manager
    from rlx.trainer import Trainer
    from rlx.validate import load_config

    reward = out / "reward.py"
    reward.write_text(REWARD_FILE)
    run_dir = out / f"{name}_run"
    overrides = [
        f"model.path={model_dir}", f"model.tokenizer_path={tok_dir}", f"model.dtype={compute_dtype()}",
        f"trainer.device={DEVICE}", f"backend.num_threads={4 if on_gpu() else 2}",
        f"data.train_files=[{data}]", "data.val_files=[]", f"data.max_prompt_length={PROMPT_TOKENS}",
        f"data.max_response_length={RESPONSE_TOKENS}", f"data.train_batch_size={PROMPTS}", f"rollout.n={SAMPLES}",
        "rollout.micro_batch_size=512", f"actor.ppo_mini_batch_size={PROMPTS}", "actor.ppo_epochs=1",
        "actor.micro_batch_size_per_device=16", "actor.log_prob_micro_batch_size_per_device=32",
        "actor.optim.lr=1e-6", "actor.optim.weight_decay=0.0", "algorithm.name=grpo", "algorithm.use_kl_loss=false",
        "algorithm.kl_loss_coef=0.0", "reward.name=custom", f"reward.path={reward}",
        f"trainer.total_steps={steps}", "trainer.test_freq=-1", "trainer.save_freq=0", "trainer.save_hf_model=false",
        "trainer.loggers=[jsonl]", f"trainer.output_dir={run_dir}", *extra,
    ]
    print(f"{name} overrides: " + " ".join(overrides), flush=True)
    pm = get_plugin_manager()
    pm.register(HeldMemory(name), name=f"benchmark-held-memory-{name}")
    if profile_path is not None:
        pm.register(StepProfiler(steps, profile_path, name), name=f"benchmark-step-profiler-{name}")
    phases = PhaseMemory(name) if on_gpu() else None
    uninstall = None
    if phases is not None:
        pm.register(phases, name=f"benchmark-phase-memory-{name}")
        uninstall = phases.install()
    fresh_peak()
    start = time.perf_counter()
    try:
        Trainer(load_config(pm, preset="tiny", overrides=overrides), pm).fit()
    finally:
        if uninstall is not None:
            uninstall()
    record(f"{name}/wall_s", time.perf_counter() - start)
    if phases is not None:  # the stages reset the counter: the run's peak is the largest seen at any reset
        phases.note()
        for key, value in sorted(phases.peaks.items()):
            record(key, value)
        record(f"{name}/peak_gib", phases.overall)
    else:
        record_peak(f"{name}/peak_gib")
    if on_gpu():
        record(f"{name}/memory_between_steps_gib", RESULTS.get(f"{name}/memory_between_steps_gib", float("nan")))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        print(f"  {name} step {r['step']}: " + ", ".join(f"{k.split('/', 1)[1]} {v:.3g}" for k, v in r.items()
                                                  if k.startswith("timing/")), flush=True)
    # Asynchronous RL: the last step generates nothing beside its training, so it is left out of the steady state.
    staleness = [o.split("=", 1)[1] for o in overrides if o.startswith("trainer.max_staleness=")]
    steady = (rows[1:-1] if staleness and staleness[-1] != "0" else rows[1:]) or rows
    for key in sorted({k for r in steady for k in r if k.startswith(("timing/", "perf/"))}):
        record(f"{name}/{key}", sum(r.get(key, 0.0) for r in steady) / len(steady))
    record(f"{name}/response_length_mean", sum(r["response_length/mean"] for r in steady) / len(steady))


def bench_trl(out: Path, model_dir: Path, tok_dir: Path, texts: list[str], steps: int) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    namespace: dict[str, Any] = {}
    exec(REWARD_FILE, namespace)  # the same score as rlx's custom reward
    score = namespace["compute_score"]

    def reward(completions: list[Any], **_: Any) -> list[float]:
        return [score(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync()
            self.times.append(time.perf_counter() - self.start)

    tok = AutoTokenizer.from_pretrained(tok_dir)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": t}]} for t in texts])
    config = GRPOConfig(
        output_dir=str(out / "trl_run"), per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1,
        num_generations=SAMPLES, max_completion_length=RESPONSE_TOKENS, steps_per_generation=1, num_iterations=1,
        learning_rate=1e-6, beta=0.0, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
        bf16=on_gpu(), use_cpu=not on_gpu(), use_vllm=False, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        model_init_kwargs={"dtype": getattr(torch, compute_dtype())},
    )
    timer = StepTimes()
    fresh_peak()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[timer])
    start = time.perf_counter()
    trainer.train()
    record("trl/wall_s", time.perf_counter() - start)
    record_peak("trl/peak_gib")
    print("  trl step times: " + ", ".join(f"{t:.3g}" for t in timer.times), flush=True)
    steady = timer.times[1:] or timer.times
    record("trl/timing/step", sum(steady) / len(steady))
    record("trl/gradient_checkpointing", bool(config.gradient_checkpointing))
    del trainer


def smoke_failures() -> list[str]:
    """What makes the smoke run fail: a part's error, or sampled log-probs away from the training forward's."""
    bad = [f"{k}: {v}" for k, v in RESULTS.items() if k.endswith("/error")]
    bad += [f"{k}: {v:.3g} (>= 1e-3)" for k, v in RESULTS.items()
            if k.endswith("/log_prob_abs_diff_vs_training_forward") and not v < 1e-3]
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=None,
                    help="GRPO steps per framework (the first is warm-up; default 5, with --smoke 2).")
    ap.add_argument("--parts", default=None,
                    help="Comma-separated, run in this order: trl, rlx, rlx_gc (rlx with gradient checkpointing, "
                    "as TRL's default), rlx_bf16 (checkpointing and bf16 weights and AdamW states, as TRL), "
                    "rlx_async (rlx with trainer.max_staleness=1: the next step generates beside training), gen. "
                    "Default trl,rlx,rlx_gc,gen; with --smoke every part.")
    ap.add_argument("--smoke", action="store_true",
                    help="A tiny model on the CPU, seconds (CI): see above. TRL's part only if trl is importable.")
    ap.add_argument("--profile", action="store_true",
                    help="Profile the last step of each rlx part (top kernels, the GPU's idle gaps) and one "
                    "generate call (top kernels).")
    ap.add_argument("--gen-variants", default=None,
                    help="rlx engines timed in 'gen': the static decoder's compile modes (off, default, max-autotune) "
                    "and dynamic (the plain decode loop). Default off,default,dynamic; with --smoke off,dynamic "
                    "(the CPU does not compile the decode step).")
    ap.add_argument("--hf-static", action="append", default=[], metavar="NAME=0|1",
                    help="A switch of the hf engine's static decoder for this run (rlx.plugins.rollout.hf_static's "
                    "module flags, e.g. REWARM=1, OWN_PREFILL=0; repeat for several): an A/B between calls.")
    ap.add_argument("--l2-prefetch", default=None, metavar="MODE[:SCHEDULE]",
                    help="the hf engine's L2 prefetch of the decode step's weights (rlx.plugins.rollout.hf_prefetch: "
                    "off, line, bulk or load; schedule mlp or mlp+next) for this run")
    ap.add_argument("--first-fit-micro-batches", action="store_true",
                    help="token-budget micro-batches as first-fit fills them (rlx.step.EVEN_MICRO_BATCHES off), "
                    "the before of the even ones")
    ap.add_argument("overrides", nargs="*", help="Extra dotted overrides for the rlx run.")
    args = ap.parse_intermixed_args()  # overrides may follow --parts and the other options
    if args.smoke and args.profile:
        ap.error("--profile records GPU kernels: not with --smoke")
    from rlx.plugins.rollout import hf_static

    switches = [n for n, v in vars(hf_static).items() if n.isupper() and n != "TYPE_CHECKING" and isinstance(v, bool)]
    for flag in args.hf_static:
        name, _, value = flag.partition("=")
        if name not in switches or value not in ("0", "1"):
            ap.error(f"--hf-static {flag}: expected NAME=0 or NAME=1, NAME one of {', '.join(switches)}")
        setattr(hf_static, name, value == "1")
        record(f"hf_static/{name}", value == "1")
    if args.l2_prefetch:
        from rlx.plugins.rollout import hf_prefetch

        mode, _, schedule = args.l2_prefetch.partition(":")
        if mode not in ("off", "line", "bulk", "load") or schedule not in ("", "mlp", "mlp+next"):
            ap.error(f"--l2-prefetch {args.l2_prefetch}: expected off, line, bulk or load, then :mlp or :mlp+next")
        hf_prefetch.MODE, hf_prefetch.SCHEDULE = mode, schedule or "mlp"  # type: ignore[assignment]
        record("hf_prefetch", args.l2_prefetch)
    if args.first_fit_micro_batches:
        from rlx import step as rlx_step

        rlx_step.EVEN_MICRO_BATCHES = False
        record("even_micro_batches", False)
    parts = (args.parts or ("trl,rlx,rlx_gc,rlx_bf16,rlx_async,gen" if args.smoke else "trl,rlx,rlx_gc,gen")).split(",")
    unknown = [p for p in parts if p not in ("trl", "rlx", "rlx_gc", "rlx_bf16", "rlx_async", "gen")]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}")
    steps = args.steps or (2 if args.smoke else 5)
    gen_variants = (args.gen_variants or ("off,dynamic" if args.smoke else "off,default,dynamic")).split(",")
    import importlib.util

    import torch
    import transformers

    if args.smoke:
        globals().update(SMOKE_SIZES)
        if "trl" in parts and importlib.util.find_spec("trl") is None:
            parts.remove("trl")
            print("smoke: trl is not importable, so only rlx's parts run (pip install trl to run TRL's too)",
                  flush=True)
    elif not torch.cuda.is_available():
        print("grpo_vs_trl.py: no GPU here (--smoke runs a tiny version on the CPU)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    record("versions", f"torch {torch.__version__}, transformers {transformers.__version__}, "
                       + (f"GPU {torch.cuda.get_device_name()}" if on_gpu() else "CPU (smoke)"))
    # the smoke run's tiny model apart from the full-size one that OUT_DIR may hold
    prefix = "smoke_" if args.smoke else ""
    model_dir, tok_dir = args.out / f"{prefix}model", args.out / f"{prefix}tokenizer"
    if not (model_dir / "config.json").exists() or not (tok_dir / "tokenizer.json").exists():
        build_model(model_dir, tok_dir)
    texts = prompt_texts(PROMPTS * steps)
    data = write_data(args.out, texts)
    sections = {"gen": lambda: bench_generation(model_dir, tok_dir, gen_variants, args.out if args.profile else None),
                "rlx": lambda: bench_rlx(args.out, model_dir, tok_dir, data, steps, args.overrides,
                                         profile_path=args.out / "step_profile.txt" if args.profile else None),
                "rlx_gc": lambda: bench_rlx(args.out, model_dir, tok_dir, data, steps,
                                            ["model.gradient_checkpointing=true", *args.overrides], "rlx_gc",
                                            args.out / "rlx_gc_step_profile.txt" if args.profile else None),
                "rlx_bf16": lambda: bench_rlx(args.out, model_dir, tok_dir, data, steps,
                                              ["model.gradient_checkpointing=true", "actor.model_dtype=bfloat16",
                                               *args.overrides], "rlx_bf16",
                                              args.out / "rlx_bf16_step_profile.txt" if args.profile else None),
                "rlx_async": lambda: bench_rlx(args.out, model_dir, tok_dir, data, steps,
                                               ["trainer.max_staleness=1", *args.overrides], "rlx_async",
                                               args.out / "rlx_async_step_profile.txt" if args.profile else None),
                "trl": lambda: bench_trl(args.out, model_dir, tok_dir, texts, steps)}
    for name in parts:
        print(f"== {name}", flush=True)
        try:
            sections[name]()
        except Exception:
            traceback.print_exc()
            record(f"{name}/error", traceback.format_exc(limit=3).splitlines()[-1])
        fresh_peak()
        (args.out / "results.json").write_text(json.dumps(RESULTS, indent=1))
    for name in ("rlx", "rlx_gc", "rlx_bf16", "rlx_async"):
        if f"{name}/timing/step" in RESULTS and "trl/timing/step" in RESULTS:
            record(f"trl_over_{name}_step_time", RESULTS["trl/timing/step"] / RESULTS[f"{name}/timing/step"])
    if "rlx_async/timing/step" in RESULTS and "rlx/timing/step" in RESULTS:  # issue 27: at most 0.75
        record("rlx_async_over_rlx_step_time", RESULTS["rlx_async/timing/step"] / RESULTS["rlx/timing/step"])
        gen, train = RESULTS.get("rlx/timing/gen", 0.0), RESULTS["rlx/timing/step"] - RESULTS.get("rlx/timing/gen", 0.0)
        record("ideal_async_over_sync", max(gen, train) / max(gen + train, 1e-9))
    (args.out / "results.json").write_text(json.dumps(RESULTS, indent=1))
    print(json.dumps(RESULTS, indent=1))
    if args.smoke and (bad := smoke_failures()):
        print("smoke run failed:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
