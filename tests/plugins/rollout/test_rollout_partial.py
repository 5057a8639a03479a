"""Partial rollouts (``rollout.partial``, issue 27): the ``hf`` engine stops where it is when interrupted, and a
response continued from its prompt and the tokens it has (``rlx.overlap``) is the response an uninterrupted
generation makes; the carry's bookkeeping (groups, versions, restarts) on hand-made batches."""

from __future__ import annotations

import pytest
import torch
from test_rollout_hf import make_rollout, other, prompts, tiny, tok  # noqa: F401  (fixtures)

from rlx.batch import Batch
from rlx.overlap import complete_groups, continuation_prompts, head_versions, restart, stitch
from rlx.protocols import SamplingParams

MAX_TOKENS = 12


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The tiny model on one thread."""


class SetAfter:
    """An interrupt that is set from its ``calls``-th look on (the engine looks once per decode step and once
    before each micro-batch)."""

    def __init__(self, calls: int) -> None:
        self.calls, self.seen = calls, 0

    def is_set(self) -> bool:
        self.seen += 1
        return self.seen > self.calls


@pytest.fixture(scope="module")
def engine(tiny, other):  # noqa: F811
    # Three prompts x n=3 in micro-batches of 4: an interrupt during the first leaves the last two unstarted.
    return make_rollout((other[1], tiny[1]), micro_batch_size=4)


def greedy(n: int = 3, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, greedy=True, max_tokens=max_tokens)


def test_interrupted_generation_stops_where_it_is(engine, prompts):  # noqa: F811
    whole = engine.generate(prompts, greedy())
    cut = engine.generate(prompts, greedy(), interrupt=SetAfter(4))
    assert cut["finished"].dtype == torch.bool and len(cut) == len(whole) == 9
    lengths, full = cut["response_mask"].sum(-1), whole["response_mask"].sum(-1)
    assert (lengths <= full).all()
    assert not cut["finished"][4:].any() and (lengths[4:] == 0).all()  # micro-batches never started
    started = lengths[:4]
    assert (started > 0).all() and (started < MAX_TOKENS).any()
    for row in range(4):  # what was made is the uninterrupted response's beginning
        k = int(lengths[row])
        assert torch.equal(cut["responses"][row, :k], whole["responses"][row, :k])
        if not cut["finished"][row]:
            assert k < int(full[row]) or k < MAX_TOKENS
    # Without an interrupt the batch has no finished column: nothing changes for the synchronous loop.
    assert "finished" not in whole


def test_continued_responses_equal_uninterrupted_ones(engine, prompts, tok):  # noqa: F811
    whole = engine.generate(prompts, greedy())
    cut = engine.generate(prompts, greedy(), interrupt=SetAfter(4))
    cut.tensors["response_versions"] = cut["response_mask"] * 3
    todo = (~cut["finished"]).nonzero().squeeze(-1)
    assert len(todo) >= 5
    rows = cut.index(todo)
    have = rows["response_mask"].sum(-1)
    new = engine.generate(continuation_prompts(rows, tok.pad_token_id),
                          greedy(n=1, max_tokens=int(MAX_TOKENS - have.min())), interrupt=SetAfter(10**6))
    done = stitch(rows, new, 4, MAX_TOKENS, tok.pad_token_id)
    assert done["finished"].all()
    for i, row in enumerate(todo.tolist()):
        k = int(whole["response_mask"][row].sum())
        assert int(done["response_mask"][i].sum()) == k
        assert torch.equal(done["responses"][i, :k], whole["responses"][row, :k]), row
        torch.testing.assert_close(done["rollout_log_probs"][i, :k], whole["rollout_log_probs"][row, :k],
                                   atol=1e-4, rtol=0)
        h = int(have[i])
        assert done["response_versions"][i, :h].eq(3).all() and done["response_versions"][i, h:k].eq(4).all()
        assert done["response_versions"][i, k:].eq(0).all()
        assert torch.equal(done["prompts"][i], rows["prompts"][i])  # the prompt stays the original one


def carry_batch() -> Batch:
    """Two groups of two: group 7 finished, group 9 with one unfinished response; versions by hand."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    return Batch({"prompts": torch.ones(4, 2, dtype=torch.long), "prompt_mask": torch.ones(4, 2, dtype=torch.long),
                  "responses": torch.arange(12).view(4, 3) * mask, "response_mask": mask,
                  "rollout_log_probs": -0.5 * mask, "response_versions": torch.tensor(
                      [[2, 3, 0], [3, 0, 0], [1, 2, 2], [4, 0, 0]]) * mask,
                  "finished": torch.tensor([True, True, True, False]), "group_index": torch.tensor([7, 7, 9, 9])},
                 {"ground_truth": ["a", "a", "b", "b"]})


def test_complete_groups_and_head_versions():
    batch = carry_batch()
    assert complete_groups(batch).tolist() == [True, True, False, False]
    assert head_versions(batch).tolist() == [2, 3, 1, 4]
    empty = restart(batch, torch.tensor([False, False, False, True]), pad_token_id=0)
    assert head_versions(empty)[3] > 10**12  # no tokens: no version yet


def test_restart_empties_only_the_chosen_rows():
    batch = carry_batch()
    out = restart(batch, torch.tensor([False, False, True, False]), pad_token_id=-1)
    assert out["response_mask"][2].eq(0).all() and out["responses"][2].eq(-1).all()
    assert out["rollout_log_probs"][2].eq(0).all() and out["response_versions"][2].eq(0).all()
    assert out["finished"].tolist() == [True, True, False, False]
    for key in ("responses", "response_mask", "response_versions"):
        assert torch.equal(out[key][[0, 1, 3]], batch[key][[0, 1, 3]]), key


def test_stitch_cuts_at_the_budget_and_marks_it_finished():
    rows = carry_batch().index([3])  # one token so far, of version 4
    new = Batch({"responses": torch.tensor([[21, 22, 23, 24]]), "response_mask": torch.ones(1, 4, dtype=torch.long),
                 "rollout_log_probs": torch.full((1, 4), -1.0), "finished": torch.tensor([False])})
    out = stitch(rows, new, 5, max_tokens=3, pad_token_id=0)
    assert out["responses"].tolist() == [[9, 21, 22]]
    assert out["response_versions"].tolist() == [[4, 5, 5]]
    assert out["rollout_log_probs"].tolist() == [[-0.5, -1.0, -1.0]]
    assert out["finished"].tolist() == [True]  # its whole budget used: finished, as a clipped response is
