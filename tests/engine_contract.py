"""The engine contract's checks now live in :mod:`rlx.testing` (importable by third-party engine plugins);
this module keeps the old import path for ``tests/test_rollout_sampling.py``."""

from rlx.testing import (
    assert_distinguishable,
    check_first_token_distribution,
    check_greedy,
    check_stops_and_length,
    next_token_logits,
    processed_distribution,
)

__all__ = [
    "assert_distinguishable",
    "check_first_token_distribution",
    "check_greedy",
    "check_stops_and_length",
    "next_token_logits",
    "processed_distribution",
]
