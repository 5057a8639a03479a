"""Workers of roles that are not models trained by a backend: the reward scorer."""

from __future__ import annotations

from typing import Any

from rlx.batch import Batch
from rlx.protocols import RewardBatch, RewardFn
from rlx.run.rewards import RewardPolicy, RewardRunner


class RewardWorker:
    """Decodes responses and scores them with a reward function; one score per response.

    The function runs under a :class:`rlx.run.rewards.RewardPolicy` (``settings``: the ``reward``
    config section or a policy): in parallel, with a time limit per call, and with failed responses
    either stopping the run or scoring ``failure_score``. Besides ``scores`` and the plugin's
    ``reward_extra/<key>`` columns, every batch gets ``reward_extra/failed`` and
    ``reward_extra/failed/<kind>`` (0/1 per response), logged as the ``reward/failed*`` fractions,
    ``reward_error`` (per response: None, or ``"kind: message"`` for a failed one), and
    ``reward_answer``: per response, the final answer the reward scored (None when the reward does not
    report answers, or failed on the response), which majority voting in evaluation uses.
    """

    def __init__(self, reward_fn: RewardFn, tokenizer: Any, name: str, settings: Any = None) -> None:
        self.tokenizer, self.name = tokenizer, name
        self.runner = RewardRunner(reward_fn, name, RewardPolicy.from_config(settings))

    def score(self, batch: Batch) -> Batch:
        import torch

        mask = batch["response_mask"]
        lengths = mask.sum(-1).tolist()
        responses = [self.tokenizer.decode(ids[: int(n)], skip_special_tokens=True)
                     for ids, n in zip(batch["responses"].tolist(), lengths)]
        rb = RewardBatch(
            prompts=list(batch.non_tensors.get("prompt_text", [""] * len(batch))),
            responses=responses,
            ground_truths=list(batch["ground_truth"]),
            data_sources=list(batch["data_source"]),
            extra_infos=list(batch["extra_info"]),
            response_lengths=[int(n) for n in lengths],
            messages=list(batch.non_tensors.get("messages", [])),
        )
        out = self.runner.run(rb)
        tensors = {"scores": torch.tensor(out.scores, dtype=torch.float32)}
        for key, values in {**out.extra, **out.failure_columns()}.items():
            tensors[f"reward_extra/{key}"] = torch.tensor(values, dtype=torch.float32)
        errors: list[str | None] = [None] * len(responses)
        for f in out.failures:
            errors[f.index] = f"{f.kind}: {f.message}"
        return Batch(tensors, {"response_text": responses, "reward_answer": list(out.answers),
                               "reward_error": errors})
