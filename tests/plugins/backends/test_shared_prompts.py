"""Shared prompts (``actor.share_prompts``): in a packed micro-batch, the rows with one prompt carry it once, and
each response attends to that one copy. The log-probs, entropies, values and gradients are those of the rows
packed whole (float32 on the CPU, the tolerances of test_packing.py: the prompt's layers run on fewer rows, so
sums are ordered differently), and the token-budget micro-batches count a group's prompt once.

A layout whose responses did not see their prompt, or saw another member's response, is off by more than 1e-2
(test_a_response_that_saw_another_response_scores_differently)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_backend_torch import PAD, grpo_loss
from test_packing import ATOL, assert_grads_close, grads, worker

from rlx.batch import Batch
from rlx.plugins.algorithms.base import CriticLoss
from rlx.plugins.modeling import packing
from rlx.plugins.modeling.packing import LAYOUT_KWARG, model_inputs
from rlx.records import LossContext
from rlx.step import micro_batches, prompt_groups

# Rows A, B, A, C, B, A: three prompts (5, 9 and 3 tokens), members not next to each other.
PROMPTS = {"A": 5, "B": 9, "C": 3}
ROWS = ["A", "B", "A", "C", "B", "A"]
RESPONSES = [6, 1, 4, 7, 3, 2]


@pytest.fixture
def model_path(tiny_model_path, one_thread):
    return tiny_model_path


def grouped_batch(rows: list[str] = ROWS, responses: list[int] = RESPONSES, seed: int = 0) -> Batch:
    """Left-padded prompts (a letter's rows have the same tokens), right-padded responses, GRPO inputs."""
    g = torch.Generator().manual_seed(seed)
    tokens = {k: torch.randint(3, 60, (n,), generator=g) for k, n in PROMPTS.items()}
    P, R, b = max(PROMPTS.values()), max(responses), len(rows)
    prompts, prompt_mask = torch.full((b, P), PAD), torch.zeros((b, P), dtype=torch.long)
    out, response_mask = torch.full((b, R), PAD), torch.zeros((b, R), dtype=torch.long)
    for i, (key, r) in enumerate(zip(rows, responses)):
        prompts[i, P - PROMPTS[key]:] = tokens[key]
        prompt_mask[i, P - PROMPTS[key]:] = 1
        out[i, :r] = torch.randint(3, 60, (r,), generator=g)
        response_mask[i, :r] = 1
    mask = response_mask.float()
    return Batch({"prompts": prompts, "prompt_mask": prompt_mask, "responses": out, "response_mask": response_mask,
                  "advantages": torch.randn(b, 1, generator=g) * mask,
                  "old_log_probs": (-2.0 - torch.rand(b, R, generator=g)) * mask})


def test_rows_are_grouped_by_their_valid_prompt_tokens():
    groups = prompt_groups(grouped_batch()).tolist()
    assert groups[0] == groups[2] == groups[5] and groups[1] == groups[4]
    assert len({groups[0], groups[1], groups[3]}) == 3
    # equal tokens at equal positions are one prompt; one valid token more is another
    batch = grouped_batch(["A", "C"], [2, 2])
    batch["prompts"][1] = batch["prompts"][0]
    batch["prompt_mask"][1] = batch["prompt_mask"][0]
    assert prompt_groups(batch).tolist() == [0, 0]
    batch["prompt_mask"][1, -PROMPTS["A"] - 1] = 1
    assert len(set(prompt_groups(batch).tolist())) == 2


def test_rows_whose_hashes_collide_are_still_grouped_by_their_tokens(monkeypatch):
    """Rows are grouped by a hash, checked token for token; where two prompts share a hash (every row here) the
    rows are compared whole instead, with the same groups."""
    from rlx import step

    batch = grouped_batch()
    want = prompt_groups(batch).tolist()
    monkeypatch.setattr(step, "_row_hash", lambda tokens, real: torch.zeros(len(tokens), dtype=torch.long))
    got = prompt_groups(batch).tolist()
    assert len(set(got)) == 3 and [[g == h for h in got] for g in got] == [[g == h for h in want] for g in want]
    firsts, groups = step.distinct_prompts(batch["prompts"], batch["prompt_mask"])
    assert sorted(firsts.tolist()) == [0, 1, 3] and groups.tolist() == got


def test_a_shared_prompt_is_packed_once_before_its_responses():
    batch = grouped_batch()
    inputs, keep = model_inputs(batch, packed=True, share_prompts=True)
    layout = inputs[LAYOUT_KWARG]
    p, r = batch["prompt_mask"].bool(), batch["response_mask"].bool()
    prompt = {k: batch["prompts"][ROWS.index(k)][p[ROWS.index(k)]] for k in PROMPTS}
    resp = [batch["responses"][i][r[i]] for i in range(len(ROWS))]
    # A, its responses (rows 0, 2, 5), B and its (1, 4), C and its (3)
    want = [prompt["A"], resp[0], resp[2], resp[5], prompt["B"], resp[1], resp[4], prompt["C"], resp[3]]
    assert torch.equal(inputs["input_ids"][0], torch.cat(want))
    positions = [range(5), range(5, 11), range(5, 9), range(5, 7), range(9), range(9, 10), range(9, 12), range(3),
                 range(3, 10)]
    assert inputs["position_ids"][0].tolist() == [i for span in positions for i in span]
    assert inputs["input_ids"].shape[1] == sum(PROMPTS.values()) + sum(RESPONSES)
    # keep, in row order: row 0 from A's last token (4), then its own; row 2's first token from 4 as well
    a_rows = {0: 5, 2: 11, 5: 15}  # where each A row's response starts in the packed row
    b_rows = {1: 17 + 9, 4: 17 + 10}
    c_row = 17 + 9 + 4 + 3
    want_keep: list[int] = []
    for i, n in enumerate(RESPONSES):
        start, last_prompt = ((a_rows[i], 4) if i in a_rows else (b_rows[i], 17 + 8) if i in b_rows
                              else (c_row, c_row - 1))
        want_keep += [last_prompt, *range(start, start + n - 1)]
    assert keep.tolist() == want_keep
    # the attention's expanded row: every response after its own copy of the prompt
    sequences = torch.tensor_split(layout.expand, layout.cu_seqlens[1:-1].long())
    assert [len(s) for s in sequences] == [PROMPTS[ROWS[i]] + RESPONSES[i] for i in (0, 2, 5, 1, 4, 3)]
    assert torch.equal(inputs["input_ids"][0][sequences[1]], torch.cat([prompt["A"], resp[2]]))
    assert torch.equal(layout.expand[layout.pick], torch.arange(inputs["input_ids"].shape[1]))


def test_without_a_shared_prompt_the_rows_pack_whole():
    batch = grouped_batch(["A", "B", "C"], [2, 3, 4])
    shared, keep = model_inputs(batch, packed=True, share_prompts=True)
    plain, plain_keep = model_inputs(batch, packed=True)
    assert LAYOUT_KWARG not in shared and torch.equal(shared["input_ids"], plain["input_ids"])
    assert torch.equal(keep, plain_keep)


def both(path: str, role: str = "ref", **options: Any):
    return worker(path, role, share_prompts=False, **options), worker(path, role, **options)


def tokens_through_the_model(w: Any, batch: Batch) -> int:
    """The packed row's length in the worker's forward pass of ``batch``: what sharing really changes."""
    from rlx.plugins.modeling.head import forward_inputs

    inputs, _, _ = forward_inputs(w.to_device(batch), w.packed, w.hf_model, w.share_prompts)
    return int(inputs["input_ids"].shape[1])


def assert_shares(whole: Any, shared: Any, batch: Batch) -> None:
    """``shared`` carries each prompt once and ``whole`` every row whole (so the comparisons compare something)."""
    assert tokens_through_the_model(shared, batch) == shared_tokens(batch) < tokens_through_the_model(whole, batch)


@pytest.mark.parametrize("chunk", [0, 5], ids=["plain-head", "chunked-head"])
def test_shared_log_probs_entropy_and_values_equal_the_whole_rows(model_path, chunk):
    batch = grouped_batch()
    mask = batch["response_mask"].bool()
    whole, shared = both(model_path, log_prob_chunk_size=chunk)
    assert_shares(whole, shared, batch)
    want, got = whole.compute_log_probs(batch, with_entropy=True), shared.compute_log_probs(batch, with_entropy=True)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got[key][mask], want[key][mask], atol=ATOL, rtol=0, msg=key)
        assert torch.all(got[key][~mask] == 0)
    critics = both(model_path, "critic")
    assert_shares(*critics, batch)
    want_v, got_v = (c.compute_values(batch)["values"] for c in critics)
    torch.testing.assert_close(got_v, want_v, atol=ATOL, rtol=0)
    assert float(want_v[mask].abs().min()) > 0


def test_a_response_that_saw_another_response_scores_differently(model_path):
    """The comparison above would catch a wrong layout: the same packed tokens and positions, with each group
    attending as one causal sequence (each response seeing the prompt and the responses before it), score
    differently."""
    model = worker(model_path, "ref").model
    inputs, keep = model_inputs(grouped_batch(), packed=True, share_prompts=True)
    shared = inputs.pop(LAYOUT_KWARG)
    whole_groups = packing._layout_of((inputs["position_ids"][0] != 0).long())  # sequences start at each prompt
    with torch.no_grad():
        right = model(**inputs, **{LAYOUT_KWARG: shared}).logits[0, keep]
        crossed = model(**inputs, **{LAYOUT_KWARG: whole_groups}).logits[0, keep]
    assert float((right - crossed).abs().max()) > 1e-2


def test_shared_gradients_equal_the_whole_rows(model_path):
    """One backward of the GRPO loss (entropy bonus on) and of the critic's loss, shared or whole."""
    batch = grouped_batch()
    ctx = LossContext(float(batch["response_mask"].sum()), float(len(batch)))
    loss_fn = grpo_loss(entropy_coeff=0.01)
    out = {}
    actors = both(model_path, "actor", log_prob_chunk_size=5)
    assert_shares(*actors, batch)
    for w in actors:
        loss, _ = loss_fn(w.forward(batch, grad=True), batch, ctx)
        loss.backward()
        out[w.share_prompts] = grads(w.model)
    assert_grads_close(out[True], out[False], "actor")
    for c in both(model_path, "critic"):
        mask = batch["response_mask"].float()
        batch.tensors["values"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * 0.1 * mask
        batch.tensors["returns"] = torch.rand(len(batch), 1, generator=torch.Generator().manual_seed(2)) * mask
        loss, _ = CriticLoss(0.2)(c.forward(batch, grad=True), batch, ctx)
        loss.backward()
        out[c.share_prompts] = grads(c.model)
    assert_grads_close(out[True], out[False], "critic")


class OneRank:
    dp_size = 1

    def __init__(self, count: float | None = None):
        self.count = count

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        return [max(values[0], self.count)] if self.count is not None and op == "max" else values


def shared_tokens(mb: Batch) -> int:
    """The tokens a micro-batch puts through the model: each prompt once, every response."""
    firsts = {g: i for i, g in reversed(list(enumerate(prompt_groups(mb).tolist())))}
    return int(mb["response_mask"].sum()) + sum(int(mb["prompt_mask"][i].sum()) for i in firsts.values())


def test_token_budget_micro_batches_count_a_shared_prompt_once():
    batch = grouped_batch()  # 17 prompt tokens once, 23 responses: 40; packed whole 5*3+9*2+3+23 = 59
    parts = micro_batches(OneRank(), batch, 8, (40, "budget"), share_prompts=True)
    assert [rows for rows, _ in parts] == [[0, 1, 2, 3, 4, 5]]
    assert len(micro_batches(OneRank(), batch, 8, (40, "budget"))) == 2  # whole rows: 59 tokens
    for budget in (13, 16, 20, 25, 31):
        parts = micro_batches(OneRank(), batch, 8, (budget, "budget"), share_prompts=True)
        assert sorted(i for rows, _ in parts for i in rows) == list(range(6))
        assert all(shared_tokens(mb) <= budget for _, mb in parts), budget
    # a prompt's rows stay together where they fit: no micro-batch mixes more than two prompts here
    parts = micro_batches(OneRank(), batch, 8, (25, "budget"), share_prompts=True)
    assert all(len({tuple(mb["prompts"][i].tolist()) for i in range(len(mb))}) <= 2 for _, mb in parts)
    # another rank needs more micro-batches than there are groups: the largest are halved by rows
    parts = micro_batches(OneRank(count=5), batch, 8, (40, "budget"), share_prompts=True)
    assert len(parts) == 5 and sorted(i for rows, _ in parts for i in rows) == list(range(6))


def one_prompt_batch(rows: int, prompt: int, response: int) -> Batch:
    return Batch({"prompts": torch.full((rows, prompt), 7), "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
                  "responses": torch.full((rows, response), 9),
                  "response_mask": torch.ones(rows, response, dtype=torch.long)})


def test_every_rank_gets_the_count_it_was_told_even_where_whole_rows_would_need_more():
    """Every rank must run as many micro-batches as the rank that needs the most (a sharded model's
    collectives must match). One prompt's 8 rows (100 + 8 x 10 tokens, one item under a budget of 200) told to
    make 2: not the 8 that whole rows of 110 tokens would need."""
    batch = one_prompt_batch(8, 100, 10)
    assert len(micro_batches(OneRank(), batch, 8, (200, "budget"), share_prompts=True)) == 1
    parts = micro_batches(OneRank(count=2), batch, 8, (200, "budget"), share_prompts=True)
    assert [rows for rows, _ in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_shared_micro_batches_keep_the_count_the_budget_and_every_row_once():
    """Random groups, lengths, budgets and counts forced by another rank."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        groups = [rng.randint(1, 6) for _ in range(rng.randint(1, 5))]
        p_max, r_max = rng.randint(1, 30), rng.randint(1, 30)
        prompts = [rng.randint(1, p_max) for _ in groups]
        rows = [(g, rng.randint(0, r_max)) for g, n in enumerate(groups) for _ in range(n)]
        rng.shuffle(rows)
        b = len(rows)
        batch = Batch({"prompts": torch.zeros(b, p_max, dtype=torch.long),
                       "prompt_mask": torch.zeros(b, p_max, dtype=torch.long),
                       "responses": torch.zeros(b, r_max, dtype=torch.long),
                       "response_mask": torch.zeros(b, r_max, dtype=torch.long)})
        for i, (g, r) in enumerate(rows):
            batch["prompts"][i, p_max - prompts[g]:] = g + 3  # a group's own tokens
            batch["prompt_mask"][i, p_max - prompts[g]:] = 1
            batch["response_mask"][i, :r] = 1
        budget = rng.randint(p_max + r_max, 4 * (p_max + r_max))
        local = len(micro_batches(OneRank(), batch, 8, (budget, "budget"), share_prompts=True))
        count = rng.randint(local, b)
        parts = micro_batches(OneRank(count=count), batch, 8, (budget, "budget"), share_prompts=True)
        assert len(parts) == count
        assert sorted(i for held, _ in parts for i in held) == list(range(b))
        assert all(shared_tokens(mb) <= budget for _, mb in parts)


def test_log_prob_pass_over_budget_micro_batches_keeps_row_order(model_path):
    batch = grouped_batch()
    whole, shared = both(model_path, use_dynamic_bsz=True, log_prob_max_token_len=20, ppo_max_token_len=20)
    want, got = whole.compute_log_probs(batch), shared.compute_log_probs(batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got["log_probs"][mask], want["log_probs"][mask], atol=ATOL, rtol=0)


def test_share_prompts_false_and_models_off_packed_sdpa_pack_whole_rows(model_path):
    assert not worker(model_path, "ref", share_prompts=False).share_prompts
    assert not worker(model_path, "ref", use_remove_padding=False).share_prompts
    assert not worker(model_path, "ref", "eager").share_prompts  # transformers' own attention reads no layout


@pytest.mark.gpu
def test_shared_prompts_on_the_varlen_kernel_give_the_whole_rows_log_probs_and_gradients(tiny_model_path):
    """On a GPU with bf16 weights the attention is PyTorch's varlen flash kernel, on the expanded row. Shared and
    whole rows agree with each other as closely as either agrees with the float32 CPU run (bf16 rounding), and
    the gradients of the GRPO loss to 5e-2 of each tensor's largest entry."""
    from test_packing import spec

    from rlx.plugins.modeling.worker import TorchBackendOptions, TorchWorker

    batch = grouped_batch()
    mask = batch["response_mask"].bool()
    ctx = LossContext(float(mask.sum()), float(len(batch)))
    want = worker(tiny_model_path, "ref", share_prompts=False).compute_log_probs(batch)["log_probs"][mask]
    got, grad = {}, {}
    for share in (False, True):
        w = TorchWorker(spec(tiny_model_path, "actor", share_prompts=share, model_dtype="bfloat16"),
                        TorchBackendOptions(), "cuda")
        assert w.share_prompts == share
        assert (tokens_through_the_model(w, batch) == shared_tokens(batch)) == share
        got[share] = w.compute_log_probs(batch)["log_probs"][mask].float()
        loss, _ = grpo_loss()(w.forward(w.to_device(batch), grad=True), w.to_device(batch), ctx)
        loss.backward()
        grad[share] = {k: v.float().cpu() for k, v in grads(w.model).items()}
    bf16_error = float((got[False] - want).abs().max())
    assert float((got[True] - got[False]).abs().max()) <= 2 * bf16_error + 1e-2
    for name, g in grad[False].items():
        torch.testing.assert_close(grad[True][name], g, atol=5e-2 * float(g.abs().max()), rtol=0, msg=name)


def test_a_model_that_hands_its_attention_a_copy_of_the_position_ids_keeps_the_shared_layout(model_path):
    """Without the layout in its keyword arguments, an attention call finds its forward's layout from the
    position ids it is given, by their values where they are a copy: not a layout read from the positions, in
    which a group's responses would attend to each other."""
    model = worker(model_path, "ref").model
    inputs, keep = model_inputs(grouped_batch(), packed=True, share_prompts=True)
    layout = inputs.pop(LAYOUT_KWARG)
    with torch.no_grad():
        want = model(**inputs, **{LAYOUT_KWARG: layout}).logits[0, keep]
        got = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"].clone()).logits[0, keep]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
