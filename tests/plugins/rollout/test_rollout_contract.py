"""The rollout-engine contract (``rlx.plugins.testing``) run against the ``hf`` engine."""

from __future__ import annotations

from typing import Any

import pytest

from rlx.plugins.rollout.hf import HFRollout, HFRolloutOptions
from rlx.plugins.testing import RolloutEngineContract


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The tiny policies run on one thread."""


class TestHFEngineContract(RolloutEngineContract):
    interruptible = True  # its component declares extra["interruptible"] (partial rollouts)

    def make_engine(self, model_path: str, tokenizer: Any) -> HFRollout:
        # One generate call for the thousands of one-token samples of the distribution checks.
        return HFRollout(model_path, HFRolloutOptions(micro_batch_size=8192), "cpu", [tokenizer.eos_token_id],
                         tokenizer.pad_token_id)
