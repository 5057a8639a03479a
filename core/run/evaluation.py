"""Evaluation metrics over n sampled responses per prompt, per data source.

For every data source (and ``all``):

- ``acc``        the fraction of responses that are correct (all n samples of every prompt);
- ``mean@n``     the mean reward score of the responses (``reward/mean`` is the same number);
- ``pass@k``     the chance that at least one of k responses drawn from a prompt's n is correct,
                 by the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` (c correct of n), averaged
                 over prompts, for k = 1, 2, 4, ... up to n and n itself;
- ``maj@n``      majority voting: the most frequent final answer among a prompt's n responses is
                 taken as the prompt's answer; the fraction of prompts where it is correct.

A response is *correct* when its reward reports so: an extra value whose last name part is
``correct`` (``gsm8k/correct``, ``math/correct``, ``arith/correct``; the largest such value counts, so
routed and mixed rewards work) is above 0.5. A reward without one counts a response as correct when
its score is at least ``threshold`` (1.0 by default). A response whose reward failed is not correct.

Majority voting uses the answer the reward scored, so that maj@1 equals acc: a reward reports it per
response through ``RewardOutput.answers`` (``gsm8k``, ``math``, ``router``, ``mix`` and ``custom`` do; the
reward worker passes it on as ``reward_answer``). For a response whose reward reports no answer, the
fallback is :func:`extract_answer` (the content of the last ``\\boxed{}``, else the number after the last
``####``, else the last number), and when that finds none, the response's whole text (stripped). Every
response votes; on a tie, an answer beats a bare text, then the answer seen first wins.

:func:`evaluate` generates and scores with any ``generate``/``score`` callables (the trainer passes its
worker groups, ``rlx eval`` its own engine); :func:`summarize` turns the records into the metrics.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from rlx.run.answers import last_boxed

if TYPE_CHECKING:
    from rlx.batch import Batch
    from rlx.protocols import SamplingParams
    from rlx.run.data import PromptExample

ALL = "all"


@dataclass
class SampleRecord:
    """One scored response."""

    prompt_index: int
    data_source: str
    score: float
    correct: bool
    answer: str | None
    prompt: str = ""
    response: str = ""
    ground_truth: Any = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- estimators ---------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c are correct: ``1 - C(n-c, k) / C(n, k)``.

    Computed as a product, so it is exact for large n (no huge binomials).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


# -- answers --------------------------------------------------------------------------------------
_NUMBER = re.compile(r"(?<![\d.])-?\d[\d,]*(?:\.\d+)?")


def _canonical_number(s: str) -> str:
    s = s.replace(",", "")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def extract_answer(text: str) -> str | None:
    """The response's final answer, normalised for voting; None if it has none."""
    if not isinstance(text, str):
        return None
    boxed = last_boxed(text)
    if boxed is not None:
        answer = re.sub(r"\s+", "", boxed.replace("\\dfrac", "\\frac").replace("\\left", "").replace("\\right", ""))
        return _canonical_number(answer) if _NUMBER.fullmatch(answer) else (answer or None)
    pos = text.rfind("####")
    tail = text[pos + 4:] if pos >= 0 else text
    numbers = _NUMBER.findall(tail.replace("$", ""))
    if numbers:
        return _canonical_number(numbers[0] if pos >= 0 else numbers[-1])
    return None


# -- correctness ----------------------------------------------------------------------------------
def correctness(scores: Sequence[float], extras: dict[str, Sequence[float]], threshold: float = 1.0) -> list[bool]:
    """Per response: correct by the reward's ``*/correct`` extras if it has any, else ``score >= threshold``."""
    keys = [k for k in extras if k.rsplit("/", 1)[-1] == "correct"]
    failed = extras.get("failed")
    out = []
    for i, s in enumerate(scores):
        ok = max(float(extras[k][i]) for k in keys) > 0.5 if keys else float(s) >= threshold
        out.append(bool(ok) and not (failed is not None and float(failed[i]) > 0.5))
    return out


# -- metrics --------------------------------------------------------------------------------------
def vote(record: SampleRecord) -> tuple[str, str]:
    """What a response votes for: its answer, or without one its whole text (so every response votes)."""
    return ("answer", record.answer) if record.answer is not None else ("text", record.response.strip())


def _group_metrics(records: list[SampleRecord], ks: Iterable[int] | None) -> dict[str, float]:
    by_prompt: dict[int, list[SampleRecord]] = {}
    for r in records:
        by_prompt.setdefault(r.prompt_index, []).append(r)
    n = min(len(v) for v in by_prompt.values())
    m: dict[str, float] = {
        "prompts": float(len(by_prompt)),
        "samples": float(len(records)),
        "acc": sum(r.correct for r in records) / len(records),
        f"mean@{n}": sum(r.score for r in records) / len(records),
        "reward/mean": sum(r.score for r in records) / len(records),
    }
    for k in ks if ks is not None else default_ks(n):
        if 1 <= k <= n:
            m[f"pass@{k}"] = sum(pass_at_k(len(v), sum(r.correct for r in v), k)
                                 for v in by_prompt.values()) / len(by_prompt)
    maj = 0
    for samples in by_prompt.values():
        votes = Counter(vote(r) for r in samples)
        winner = max(votes, key=lambda key: (votes[key], key[0] == "answer"))  # the first of equals wins
        maj += any(r.correct for r in samples if vote(r) == winner)
    m[f"maj@{n}"] = maj / len(by_prompt)
    return m


def summarize(records: list[SampleRecord], ks: Iterable[int] | None = None) -> dict[str, dict[str, float]]:
    """Metrics per data source, and over everything under ``"all"``."""
    if not records:
        return {}
    sources: dict[str, list[SampleRecord]] = {}
    for r in records:
        sources.setdefault(r.data_source, []).append(r)
    ks = list(ks) if ks is not None else None
    out = {src: _group_metrics(recs, ks) for src, recs in sorted(sources.items())}
    out[ALL] = _group_metrics(records, ks)
    return out


def flatten(summary: dict[str, dict[str, float]], prefix: str = "val") -> dict[str, float]:
    """``{"all": {"acc": ..}, "src": {...}}`` -> ``{"val/acc": .., "val/src/acc": ..}`` (counts left out)."""
    out: dict[str, float] = {}
    for src, metrics in summary.items():
        for key, value in metrics.items():
            if key in ("prompts", "samples"):
                continue
            out[f"{prefix}/{key}" if src == ALL else f"{prefix}/{src}/{key}"] = value
    return out


# -- generation and scoring -----------------------------------------------------------------------
def records_from(scored: Batch, *, first_prompt: int, n: int, threshold: float = 1.0) -> list[SampleRecord]:
    """Records of a generated-and-scored batch whose rows are n samples per prompt, prompt after prompt.

    A record's ``answer`` is the reward's (``reward_answer``), else the one :func:`extract_answer` finds.
    """
    scores = [float(s) for s in scored["scores"].tolist()]
    extras = {k.split("/", 1)[1]: scored[k].tolist() for k in scored.tensors if k.startswith("reward_extra/")}
    ok = correctness(scores, extras, threshold)
    texts = scored["response_text"] if "response_text" in scored else [""] * len(scores)
    prompts = scored["prompt_text"] if "prompt_text" in scored else [""] * len(scores)
    truths = scored["ground_truth"] if "ground_truth" in scored else [None] * len(scores)
    scored_answers = scored["reward_answer"] if "reward_answer" in scored else [None] * len(scores)
    answers = [a if a is not None else extract_answer(t) for a, t in zip(scored_answers, texts)]
    return [SampleRecord(first_prompt + i // n, scored["data_source"][i], scores[i], ok[i], answers[i],
                         prompts[i], texts[i], truths[i])
            for i in range(len(scores))]


def evaluate(examples: list[PromptExample], *, generate: Callable[[Batch, SamplingParams], Batch],
             score: Callable[[Batch], Batch], params: SamplingParams, batch_size: int, pad_token_id: int,
             threshold: float = 1.0, progress: Callable[[int, int], None] | None = None,
             vision: Any = None) -> list[SampleRecord]:
    """Generate ``params.n`` responses for every prompt, score them, and return one record per response
    (``vision``: the :class:`rlx.run.vision.VisionPrompts` of prompts with images)."""
    from rlx.run.data import collate

    records: list[SampleRecord] = []
    for start in range(0, len(examples), batch_size):
        prompts = collate(examples[start:start + batch_size], pad_token_id, vision)
        out = generate(prompts, params)
        out.update(score(out))
        records.extend(records_from(out, first_prompt=start, n=params.n, threshold=threshold))
        if progress is not None:
            progress(min(start + batch_size, len(examples)), len(examples))
    return records
