"""Reward modeling (``rlx rm train``): a sequence classifier with one output trained on preference pairs.

Each pair (prompt, chosen, rejected) is shown to the model as two conversations, the prompt's messages
followed by each reply, rendered with the model's chat template exactly as the ``reward_model`` reward
renders a rollout, so the scores it learns are the scores PPO sees. The reward of a conversation is the
classifier's output at its last token; for a pair, r_c (chosen) and r_r (rejected), the loss is the
Bradley-Terry negative log-likelihood with an optional margin m and a centering term of coefficient c::

    loss = -log sigmoid(r_c - r_r - m) + c * (r_c + r_r)^2

averaged over the pairs of a step. Metrics (``train/...`` per step and ``val/...`` on the held-out pairs):
``loss``, ``accuracy`` (the share of pairs with r_c > r_r; a tie counts a half), ``margin`` (mean
r_c - r_r), ``chosen`` and ``rejected`` (mean rewards).

The model starts from a causal LM (a new one-output head, initialised from ``trainer.seed``) or from a
sequence classifier with one output (its head is kept). The run folder is laid out as ``rlx train``'s:
``config.yaml``, ``metrics.jsonl``, atomic verified ``checkpoints/`` that a run resumes from, and the
final model in ``hf_model/`` (a sequence-classification folder with its tokenizer: ``reward.path``).
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.errors import UserError, describe_exception
from rlx.plugins.modeling import checkpointing
from rlx.plugins.modeling.model import pick_device
from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker
from rlx.plugins.tasks.datasets import (
    PreferencePair,
    conversation_ids,
    file_problem,
    preference_column_problems,
    preference_pair,
    read_records,
    render,
)
from rlx.protocols import RoleSpec, RunInfo
from rlx.run import checkpoint
from rlx.run.files import check_run_folder_links, is_private, make_tree_private, write_private

if TYPE_CHECKING:
    import torch

    from rlx.plugins.reward_modeling.config import ResolvedRM, RMDataConfig
    from rlx.registry import PluginManager

MAX_REPORTED = 20
METRICS = ("loss", "accuracy", "margin", "chosen", "rejected")


# -- the loss ---------------------------------------------------------------------------------------
def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                  center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair loss (n,): ``-log sigmoid(r_c - r_r - m) + c * (r_c + r_r)^2``, in float32."""
    import torch.nn.functional as F

    diff = chosen.float() - rejected.float()
    if margin is not None:
        diff = diff - margin.float()
    loss = -F.logsigmoid(diff)
    if center_coef:
        loss = loss + center_coef * (chosen.float() + rejected.float()) ** 2
    return loss


def pair_sums(chosen: torch.Tensor, rejected: torch.Tensor, losses: torch.Tensor) -> dict[str, float]:
    """Sums over pairs of each metric (divide by the pair count for the means)."""
    c, r = chosen.detach().float(), rejected.detach().float()
    wins = (c > r).float() + 0.5 * (c == r).float()
    return {"loss": float(losses.detach().sum()), "accuracy": float(wins.sum()), "margin": float((c - r).sum()),
            "chosen": float(c.sum()), "rejected": float(r.sum())}


# -- data -------------------------------------------------------------------------------------------
@dataclass
class TokenPair:
    chosen: list[int]
    rejected: list[int]
    margin: float


@dataclass
class PairSet:
    """Tokenized pairs; ``examples`` and ``len`` let :class:`rlx.run.data.PromptLoader` batch them."""

    examples: list[TokenPair]
    dropped_overlong: int = 0
    longest: int = 0

    def __len__(self) -> int:
        return len(self.examples)


def read_pairs(refs: list[str], data: RMDataConfig, source_key: str) -> list[PreferencePair]:
    """Every pair of the files; a :class:`UserError` listing the bad rows (index and reason) if any."""
    from rlx.run.data import resolve_path

    pairs: list[PreferencePair] = []
    bad: list[str] = []
    rows_seen = 0
    for ref in refs:
        path = Path(resolve_path(ref))
        problem = file_problem(path)
        if problem == "is a folder, not a file":
            raise UserError(f"{source_key}: {ref} is a folder; give a preference file (parquet, JSONL or JSON).")
        if problem == "does not exist":
            raise UserError(f"{source_key}: {ref}: no such file.")
        if problem is not None:
            raise UserError(f"{source_key}: cannot read {ref}: {problem}.")
        rows = read_records(path)
        missing = preference_column_problems(rows, ref, prompt_key=data.prompt_key, chosen_key=data.chosen_key,
                                             rejected_key=data.rejected_key, margin_key=data.margin_key)
        if missing:
            margin = (f" data.margin_key={data.margin_key} names the margin column; leave it unset (null) for "
                      "no margin." if data.margin_key is not None else "")
            raise UserError(f"{source_key}: " + "\n".join(missing),
                            "Name the columns with data.prompt_key, data.chosen_key and data.rejected_key."
                            + margin)
        rows_seen += len(rows)
        for i, row in enumerate(rows):
            pair, problems = preference_pair(row, prompt_key=data.prompt_key, chosen_key=data.chosen_key,
                                             rejected_key=data.rejected_key, margin_key=data.margin_key)
            if pair is None:
                bad.append(f"  {ref}: row {i}: {'; '.join(problems)}")
            else:
                pairs.append(pair)
    where = f"{source_key} ({', '.join(refs)})"
    if bad:
        more = f"\n  ... and {len(bad) - MAX_REPORTED} more" if len(bad) > MAX_REPORTED else ""
        raise UserError(f"{where}: {len(bad)} of {rows_seen} preference rows are not usable:\n"
                        + "\n".join(bad[:MAX_REPORTED]) + more,
                        f"Each row needs {data.prompt_key!r} (text or chat messages) and {data.chosen_key!r} / "
                        f"{data.rejected_key!r} replies that differ; `rlx data validate FILE` lists every bad row "
                        "and `rlx data prepare preference` drops them.")
    if not pairs:
        raise UserError(f"{where} holds no preference pairs.",
                        "Give files with prompt/chosen/rejected rows; `rlx data prepare preference` writes them.")
    return pairs


def tokenize_pairs(pairs: list[PreferencePair], tokenizer: Any, max_length: int, source_key: str) -> PairSet:
    """Both sides of every pair as token ids; pairs with a side over ``max_length`` tokens are dropped and
    counted (a truncated side could lose exactly the part that makes it better or worse)."""
    out: list[TokenPair] = []
    dropped = longest = 0
    for i, p in enumerate(pairs):
        try:
            c = conversation_ids(tokenizer, p.prompt, p.chosen)
            r = conversation_ids(tokenizer, p.prompt, p.rejected)
        except Exception as exc:  # a template may reject a conversation (roles must alternate, ...)
            raise UserError(f"{source_key}: pair {i}: the chat template rejects its conversation: "
                            f"{type(exc).__name__}: {exc}",
                            "Fix the row's messages (the roles this model's template accepts, in its order).") from None
        longest = max(longest, len(c), len(r))
        if max(len(c), len(r)) > max_length:
            dropped += 1
            continue
        out.append(TokenPair(c, r, p.margin))
    if not out:
        raise UserError(f"{source_key}: every pair has a side longer than data.max_length={max_length} tokens "
                        f"(longest {longest}).", "Raise data.max_length.")
    return PairSet(out, dropped, longest)


# -- the model --------------------------------------------------------------------------------------
def start_kind(path: str, trust_remote_code: bool, key: str = "model.path") -> str:
    """``classifier`` (a sequence classifier with one output) or ``causal_lm``; a :class:`UserError` for a
    folder that is neither, so that training never starts from weights it would mostly throw away."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from rlx.run.models import check_model_folder

    check_model_folder(path, trust_remote_code, key=key, tokenizer=False)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{key}: cannot read the model config of {path!r}: {exc}") from None
    archs = list(getattr(config, "architectures", None) or [])
    if any(a.endswith("ForSequenceClassification") for a in archs):
        if config.num_labels != 1:
            raise UserError(f"{key}: {path!r} is a sequence classifier with {config.num_labels} outputs; a reward "
                            "model has one.",
                            "Start from a causal LM (a new one-output head is put on it) or a reward model.")
        return "classifier"
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if any(a in causal or a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal_lm"
    found = ", ".join(archs) if archs else "no architecture in its config.json"
    raise UserError(f"{key}: {path!r} is neither a sequence classifier nor a causal LM ({found}), so there is "
                    "nothing to train a reward model from.",
                    "Give a causal LM checkpoint (a reward head is put on it) or a sequence-classification reward "
                    "model with one output.")


class RewardModelWorker(TorchWorker):
    """The ``torch`` backend's worker holding a one-output sequence classifier instead of a causal LM.

    The optimizer, its schedule, gradient clipping, the skipped non-finite step, and the checkpoint and
    Hugging Face writers are the backend's own; only the model and its forward pass differ.
    """

    def __init__(self, spec: RoleSpec, options: TorchBackendOptions, device: str = "auto") -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from rlx.config import resolve_dtype

        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        self.spec, self.options = spec, options
        self.device = pick_device(device)
        self.rank, self.dp_size = 0, 1
        torch.manual_seed(spec.seed)  # the new head's initial weights
        self.compute_dtype = getattr(torch, resolve_dtype(spec.dtype, self.device))
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                spec.model_path, num_labels=1, dtype=torch.float32, trust_remote_code=spec.trust_remote_code,
                attn_implementation=options.attn_implementation)
        except ValueError as exc:
            if "Unrecognized configuration class" not in str(exc):
                raise
            raise UserError(f"Cannot put a reward head on {spec.model_path!r}: transformers has no "
                            "sequence-classification class for its architecture.",
                            "Start from a model whose architecture has one (e.g. Qwen2, Llama, Mistral).") from None
        model.config.classifier_dropout = 0.0
        self.model = model.to(self.device)
        self.autocast = self.device != "cpu" and self.compute_dtype != torch.float32
        if spec.gradient_checkpointing:
            checkpointing.enable(self.model)
        self._set_up_optimizer()

    def set_pad_token_id(self, pad_token_id: int) -> None:
        """The classifier reads its output at the last token that is not padding, found by this id."""
        self.model.config.pad_token_id = pad_token_id
        self.pad_token_id = pad_token_id

    def rewards(self, sequences: list[list[int]]) -> torch.Tensor:
        """One reward per token sequence (n,), the sequences right-padded into one forward pass."""
        import torch

        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, :len(s)] = 1
        with self._precision():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return logits[:, 0].float()

    def pair_rewards(self, pairs: list[TokenPair]) -> tuple[torch.Tensor, torch.Tensor]:
        """(r_c, r_r) of the pairs, both sides in one forward pass."""
        r = self.rewards([p.chosen for p in pairs] + [p.rejected for p in pairs])
        return r[:len(pairs)], r[len(pairs):]

    def train_pairs(self, pairs: list[TokenPair], center_coef: float) -> dict[str, float]:
        """One optimizer step on ``pairs``, accumulating over micro-batches: each micro-batch's loss is its
        pairs' sum divided by the step's pair count, so the accumulated gradient is the step's mean loss's."""
        import torch

        self.model.train()
        self.zero_grad()
        sums = dict.fromkeys(METRICS, 0.0)
        size = self.spec.micro_batch_size
        for start in range(0, len(pairs), size):
            micro = pairs[start:start + size]
            chosen, rejected = self.pair_rewards(micro)
            margin = torch.tensor([p.margin for p in micro], device=chosen.device)
            losses = pairwise_loss(chosen, rejected, margin, center_coef)
            self.backward(losses.sum() / len(pairs))
            for k, v in pair_sums(chosen, rejected, losses).items():
                sums[k] += v
        grad_norm, applied, lr = self.optimizer_step()
        out = {k: v / len(pairs) for k, v in sums.items()}
        out.update(grad_norm=grad_norm, lr=lr, skipped_step=float(not applied))
        return out

    def evaluate_pairs(self, pairs: list[TokenPair], batch_size: int, center_coef: float) -> dict[str, float]:
        """Mean metrics over ``pairs`` without gradients, in eval mode."""
        import torch

        was_training = self.model.training
        self.model.eval()
        sums = dict.fromkeys(METRICS, 0.0)
        try:
            with torch.no_grad():
                for start in range(0, len(pairs), batch_size):
                    micro = pairs[start:start + batch_size]
                    chosen, rejected = self.pair_rewards(micro)
                    margin = torch.tensor([p.margin for p in micro], device=chosen.device)
                    for k, v in pair_sums(chosen, rejected, pairwise_loss(chosen, rejected, margin,
                                                                          center_coef)).items():
                        sums[k] += v
        finally:
            self.model.train(was_training)
        return {k: v / len(pairs) for k, v in sums.items()}


# -- the job ----------------------------------------------------------------------------------------
class RewardModelTrainer:
    """Loads the data and the model, then trains, validates, logs and checkpoints as ``rlx train`` does."""

    def __init__(self, resolved: ResolvedRM, pm: PluginManager) -> None:
        import torch

        from rlx.context import BuildContext
        from rlx.run.data import PromptLoader, resolve_path
        from rlx.run.models import load_tokenizer

        self.resolved, self.cfg, self.pm = resolved, resolved.config, pm
        cfg = self.cfg
        self.config_dict = resolved.as_dict()
        self.model_path = resolve_path(cfg.model.path)
        self.start = start_kind(self.model_path, cfg.model.trust_remote_code)
        self.run_dir = cfg.run_dir()
        self.ckpt_root = self.run_dir / "checkpoints"
        check_run_folder_links(self.run_dir)  # its own files are never links to elsewhere
        self.resume_from = checkpoint.resume_point(self.ckpt_root, self.run_dir, self.cfg.trainer.resume)
        if self.resume_from is not None:  # other data, model, optimiser... is a new run, not this one
            checkpoint.check_resumable(self.run_dir, self.resume_from, self.config_dict, checkpoint.RM_RESUME_KEYS)
        checkpoint.make_dir(self.run_dir, private=cfg.trainer.private_run_dir)
        random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        m = cfg.model
        self.tokenizer = load_tokenizer(resolve_path(m.tokenizer_path or m.path), m.trust_remote_code,
                                        key="model.tokenizer_path" if m.tokenizer_path else "model.path",
                                        require_chat_template=False)
        d = cfg.data
        self.train_set = tokenize_pairs(read_pairs(d.train_files, d, "data.train_files"), self.tokenizer,
                                        d.max_length, "data.train_files")
        self.val_set = tokenize_pairs(read_pairs(d.val_files, d, "data.val_files"), self.tokenizer, d.max_length,
                                      "data.val_files") if d.val_files else None
        for name, s in (("training", self.train_set), ("validation", self.val_set)):
            if s is not None and s.dropped_overlong:
                print(f"Dropped {s.dropped_overlong} {name} pairs with a side longer than data.max_length="
                      f"{d.max_length} tokens (longest {s.longest}); {len(s)} remain.", file=sys.stderr)
        if len(self.train_set) < d.train_batch_size:
            raise UserError(f"The training set has {len(self.train_set)} usable pairs, fewer than "
                            f"data.train_batch_size={d.train_batch_size}.", "Lower data.train_batch_size or add data.")
        self.loader = PromptLoader(self.train_set, d.train_batch_size, shuffle=d.shuffle,  # type: ignore[arg-type]
                                   seed=cfg.trainer.seed)
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * self.loader.batches_per_epoch()
        o = cfg.optim
        spec = RoleSpec(role="reward_model", model_path=self.model_path, trainable=True, dtype=m.dtype, lr=o.lr,
                        weight_decay=o.weight_decay, betas=o.betas, warmup_steps=o.warmup_steps,
                        total_steps=self.total_steps, lr_schedule=o.lr_schedule, grad_clip=o.grad_clip,
                        micro_batch_size=cfg.rm.micro_batch_size_per_device,
                        gradient_checkpointing=m.gradient_checkpointing, seed=cfg.trainer.seed,
                        trust_remote_code=m.trust_remote_code, min_lr_ratio=o.min_lr_ratio)
        self.worker = RewardModelWorker(spec, resolved.options.get("backend") or TorchBackendOptions(),
                                        cfg.trainer.device)
        self.worker.set_pad_token_id(self.tokenizer.pad_token_id)
        resumed_step = checkpoint.read_state(self.resume_from)["step"] if self.resume_from is not None else 0
        run = RunInfo(str(self.run_dir), cfg.trainer.project, cfg.trainer.experiment, self.config_dict,
                      resumed=self.resume_from is not None, resumed_step=resumed_step)
        ctx = BuildContext(None, run, pm, self.tokenizer)
        self.loggers = {name: pm.build("logger", name, resolved.options.get(f"loggers.{name}"), ctx)
                        for name in cfg.trainer.loggers}
        self.step = 0
        self.saved_step: int | None = None

    def fit(self) -> dict[str, float]:
        import yaml

        t = self.cfg.trainer
        metrics: dict[str, float] = {}
        try:
            if self.resume_from is not None:
                self._load(self.resume_from)
                if self.step >= self.total_steps:
                    return metrics  # nothing to do, said by _load; the run's record and model stay as they are
            if self.resume_from is None or not (self.run_dir / "config.yaml").is_file():
                # A run's record is written once, by the run that made it; a resume leaves it as it is.
                write_private(self.run_dir / "config.yaml", yaml.safe_dump(self.config_dict, sort_keys=False))
            if self.val_set is not None and t.val_before_train and self.step == 0:
                self._log(self.validate(), 0)
            while self.step < self.total_steps:
                self.step += 1
                metrics = self.train_step(self._next_pairs())
                if self.val_set is not None and t.test_freq > 0 and (
                        self.step % t.test_freq == 0 or self.step == self.total_steps):
                    metrics.update(self.validate())
                self._log(metrics, self.step)
                if t.save_freq > 0 and self.step % t.save_freq == 0 and self.step < self.total_steps:
                    self.save()
            if t.save_freq != 0 and self.saved_step != self.step:
                self.save()
            if t.save_hf_model:
                self.save_hf(self.run_dir / "hf_model")
        finally:
            for name in list(self.loggers):
                self._call_logger(name, "finish")
        return metrics

    def _next_pairs(self) -> list[TokenPair]:
        for pairs in self.loader:
            return pairs  # type: ignore[return-value]
        self.loader.next_epoch()
        for pairs in self.loader:
            return pairs  # type: ignore[return-value]
        raise RuntimeError("the pair loader yields no batch")

    def train_step(self, pairs: list[TokenPair]) -> dict[str, float]:
        start = time.perf_counter()
        out = self.worker.train_pairs(pairs, self.cfg.rm.center_rewards_coefficient)
        seconds = time.perf_counter() - start
        tokens = sum(len(p.chosen) + len(p.rejected) for p in pairs)
        metrics = {f"train/{k}": v for k, v in out.items()}
        metrics.update({"timing/step": seconds, "perf/total_tokens": float(tokens),
                        "perf/tokens_per_second": tokens / max(seconds, 1e-9),
                        "progress/epoch": float(self.loader.epoch), "progress/total_steps": float(self.total_steps)})
        return metrics

    def validate(self) -> dict[str, float]:
        assert self.val_set is not None
        out = self.worker.evaluate_pairs(self.val_set.examples, self.cfg.data.val_batch_size,
                                         self.cfg.rm.center_rewards_coefficient)
        return {f"val/{k}": v for k, v in out.items()}

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for name in list(self.loggers):
            self._call_logger(name, "log", metrics, step)

    def _call_logger(self, name: str, method: str, *args: Any) -> None:
        try:
            getattr(self.loggers[name], method)(*args)
        except Exception as exc:
            del self.loggers[name]
            print(f"Warning: logger {name!r} failed in {method} at step {self.step} ({describe_exception(exc)}); "
                  f"it is switched off for the rest of the run. Still logging to: "
                  f"{', '.join(self.loggers) or 'nothing'}.", file=sys.stderr)

    # -- checkpoints ----------------------------------------------------------------------------------
    def save(self) -> Path:
        path = checkpoint.save(self.ckpt_root, self.step,
                               lambda tmp: self.worker.save_checkpoint(str(tmp / "reward_model")),
                               {"loader": self.loader.state_dict()}, keep=self.cfg.trainer.max_checkpoints_to_keep)
        self.saved_step = self.step
        return path

    def _load(self, path: Path) -> None:
        state = checkpoint.read_state(path)
        if not (path / "reward_model").is_dir():
            raise UserError(f"{path} holds no reward model: it was not written by `rlx rm train`.",
                            "Choose another trainer.output_dir or trainer.experiment for this run.")
        self.worker.load_checkpoint(str(path / "reward_model"))
        self.loader.load_state_dict(state["loader"])
        self.step = self.saved_step = int(state["step"])
        print(f"Resuming from {path} (step {self.step}).")
        if self.step >= self.total_steps:
            print(f"Run already finished at step {self.step}/{self.total_steps}; nothing to do. To train longer "
                  f"set trainer.total_steps={self.step + self.total_steps}; for a new run set trainer.experiment=NAME.")

    def save_hf(self, target: Path) -> None:
        """The reward model as a Hugging Face sequence-classification folder with its tokenizer, written
        atomically: what ``reward.name=reward_model reward.path=...`` loads."""
        tmp = target.with_name(f".tmp-{target.name}")
        checkpoint.remove_tree(tmp)
        checkpoint.make_dir(tmp)
        self.worker.save_pretrained(str(tmp), self.tokenizer)
        if is_private(target.parent):  # the run folder is owner-only: so is the model written into it
            make_tree_private(tmp)
        checkpoint.replace_dir(tmp, target)


def train_reward_model(resolved: ResolvedRM, pm: PluginManager) -> tuple[RewardModelTrainer, dict[str, float]]:
    trainer = RewardModelTrainer(resolved, pm)
    return trainer, trainer.fit()


# -- evaluation of a trained reward model -----------------------------------------------------------
def evaluate_reward_model(path: str, files: list[str], data: RMDataConfig, *, batch_size: int = 8,
                          max_length: int = 2048, device: str = "auto") -> dict[str, Any]:
    """Pairwise accuracy of the reward model at ``path`` on held-out pairs, scored by the ``reward_model``
    reward's own code (its tokenizer, chat template, truncation and last-token logit): the numbers hold for
    the scores PPO will see."""
    from rlx.plugins.modeling.reward_model import RewardModelOptions, RewardModelScorer

    pairs = read_pairs(files, data, "--data")
    try:
        opts = RewardModelOptions(path=path, batch_size=batch_size, max_length=max_length, device=device)  # type: ignore[arg-type]
    except ValueError as exc:
        raise UserError(f"--reward-model {path}: {exc}") from None
    scorer = RewardModelScorer(opts)
    tok = scorer.tokenizer
    texts = [render(tok, p.prompt, side) for p in pairs for side in (p.chosen, p.rejected)]
    logits = scorer.logits(texts)
    import torch

    chosen, rejected = torch.tensor(logits[0::2]), torch.tensor(logits[1::2])
    margin = torch.tensor([p.margin for p in pairs])
    sums = pair_sums(chosen, rejected, pairwise_loss(chosen, rejected, margin))
    return {"reward_model": path, "data": list(files), "pairs": len(pairs),
            **{k: v / len(pairs) for k, v in sums.items()}}
