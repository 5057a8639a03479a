"""Workers of roles that are not models trained by a backend: the reward scorer."""

from __future__ import annotations

import math
from typing import Any

from rlx.batch import Batch
from rlx.protocols import RewardBatch, RewardFn, RewardOutput


class RewardWorker:
    """Decodes responses and scores them with a reward function; one score per response."""

    def __init__(self, reward_fn: RewardFn, tokenizer: Any, name: str) -> None:
        self.reward_fn, self.tokenizer, self.name = reward_fn, tokenizer, name

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
        )
        result = self.reward_fn(rb)
        out = result if isinstance(result, RewardOutput) else RewardOutput(list(result))
        if len(out.scores) != len(rb):
            raise RuntimeError(f"reward {self.name!r} returned {len(out.scores)} scores for {len(rb)} responses")
        bad = [i for i, s in enumerate(out.scores) if not isinstance(s, (int, float)) or not math.isfinite(s)]
        if bad:
            raise RuntimeError(f"reward {self.name!r} returned a non-finite score for response {bad[0]}: "
                               f"{out.scores[bad[0]]!r} (response text: {responses[bad[0]][:200]!r})")
        tensors = {"scores": torch.tensor(out.scores, dtype=torch.float32)}
        for key, values in out.extra.items():
            tensors[f"reward_extra/{key}"] = torch.tensor(values, dtype=torch.float32)
        return Batch(tensors, {"response_text": responses})
