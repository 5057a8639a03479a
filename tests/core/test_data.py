"""Prompt data: row validation, chat-template tokenization with over-long filtering, the resumable
prompt loader and left-padded collation."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from rlx.errors import UserError
from rlx.run.data import (
    PromptDataset,
    PromptExample,
    PromptLoader,
    collate,
    load_prompts,
    read_rows,
    validate_rows,
)


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    """The built-in tiny model's tokenizer."""
    return AutoTokenizer.from_pretrained(tiny_model_path)


def row(content: str = "What is 1+2?", i: int = 0, **overrides) -> dict:
    r = {
        "prompt": [{"role": "user", "content": content}],
        "data_source": "test/arith",
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"index": i},
    }
    r.update(overrides)
    return r


def write_parquet(path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# ---------------------------------------------------------------------------------------------
# validation
def test_validate_rows_reports_every_bad_row_at_once(tmp_path):
    good = row()
    rows = [
        good,
        row(prompt=None),  # 1 missing prompt
        row(prompt=[]),  # 2 empty list
        row(prompt=[{"role": None, "content": "hi"}]),  # 3 message without a role
        row(data_source=None),  # 4 missing data_source
        row(reward_model={"style": "rule", "ground_truth": None}),  # 5 missing ground truth
        good,
    ]
    # Rows read back from parquet, as in real use; extra_info of another type needs its own file.
    rows = read_rows([write_parquet(tmp_path / "a.parquet", rows),
                      write_parquet(tmp_path / "b.parquet", [row(extra_info="not a dict")])])
    assert len(rows) == 8
    with pytest.raises(UserError) as info:
        validate_rows(rows, "train_files")
    msg = info.value.message
    assert "train_files: 6 of 8 rows are not usable" in msg
    reasons = {
        1: "missing 'prompt'",
        2: "'prompt' must be a non-empty list of chat messages",
        3: "prompt[0] must be {'role': str, 'content': str}",
        4: "missing 'data_source'",
        5: "missing 'reward_model.ground_truth'",
        7: "'extra_info' must be a mapping",
    }
    lines = {int(line.split()[1].rstrip(":")): line for line in msg.splitlines() if line.startswith("  row ")}
    assert sorted(lines) == sorted(reasons)
    for i, reason in reasons.items():
        assert reason in lines[i], (i, lines[i])
    assert "row 0" not in msg and "row 6" not in msg
    assert info.value.hint and "ground_truth" in info.value.hint


def test_validate_rows_several_problems_in_one_row_and_limits():
    rows = [{"prompt": "  ", "reward_model": "x"}, "not a row"]
    with pytest.raises(UserError) as info:
        validate_rows(rows, "src")
    msg = info.value.message
    assert "row 0: 'prompt' is empty; missing 'data_source'" in msg and "'reward_model' must be a mapping" in msg
    assert "row 1: row is a str, not a mapping" in msg
    with pytest.raises(UserError, match="and 5 more"):
        validate_rows([row(prompt=None)] * 25, "src")
    with pytest.raises(UserError, match="has no rows"):
        validate_rows([], "src")
    validate_rows([row(), row(prompt="a plain string prompt", extra_info=None)], "src")  # fine


def test_read_rows_rejects_non_parquet(tmp_path):
    bad = tmp_path / "rows.parquet"
    bad.write_text('{"prompt": "not parquet"}\n')
    with pytest.raises(UserError, match=r"Cannot read .* as parquet"):
        read_rows([str(bad)])
    with pytest.raises(UserError, match="as parquet"):
        read_rows([str(tmp_path / "missing.parquet")])


def test_wrong_types_are_named_not_called_missing(tmp_path):
    rows = read_rows([write_parquet(tmp_path / "a.parquet", [row(data_source=5, reward_model="7")]),
                      write_parquet(tmp_path / "b.parquet", [row(prompt=5)]),
                      write_parquet(tmp_path / "c.parquet", [row(prompt={"role": "user", "content": "x"})]),
                      write_parquet(tmp_path / "d.parquet", [row(reward_model={"ground_truth": float("nan")})])])
    with pytest.raises(UserError) as info:
        validate_rows(rows, "src")
    msg = info.value.message
    assert "row 0: 'data_source' must be a string naming the data set (got int); 'reward_model' must be a " \
           "mapping with a 'ground_truth' (got str)" in msg
    assert "row 1: 'prompt' must be a non-empty list of chat messages" in msg
    assert "row 2: 'prompt' must be a non-empty list of chat messages" in msg  # a struct, not a list
    assert "row 3: 'reward_model.ground_truth' is nan, which no answer can equal" in msg


def test_read_rows_rejects_an_empty_file(tmp_path):
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(UserError, match=r"Cannot read .*empty\.parquet as parquet"):
        read_rows([str(tmp_path / "empty.parquet")])


def test_a_chat_template_that_rejects_a_conversation_names_the_row(tmp_path, tiny_model_path):
    strict = AutoTokenizer.from_pretrained(tiny_model_path)
    strict.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                            "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                            "{{ m['content'] }}{% endfor %}")
    bad = row(prompt=[{"role": "assistant", "content": "hi"}])
    f = write_parquet(tmp_path / "p.parquet", [row(), bad])
    with pytest.raises(UserError) as info:
        load_prompts([f], strict, prompt_key="prompt", max_prompt_length=512, filter_overlong=True,
                     source_key="data.train_files")
    assert "data.train_files" in info.value.message and "row 1: the chat template rejects its 'prompt'" in \
        info.value.message
    assert "Conversation roles must alternate" in info.value.message


# ---------------------------------------------------------------------------------------------
# load_prompts
def prompt_files(tmp_path, tok):
    """A file of 4 short prompts and 2 long ones (rows 1 and 4), their token ids and the length bounds."""
    short = [row(f"What is {i}+1?", i) for i in range(4)]
    long = [row("What is " + "+".join("123456789") * 4 + "?", 10 + i) for i in range(2)]
    rows = [short[0], long[0], short[1], short[2], long[1], short[3]]
    path = write_parquet(tmp_path / "train.parquet", rows)
    ids = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for r in rows]
    short_max, long_min = max(len(ids[i]) for i in (0, 2, 3, 5)), min(len(ids[i]) for i in (1, 4))
    assert short_max < long_min
    return path, rows, ids, short_max, long_min


def test_load_prompts_applies_chat_template_and_filters(tmp_path, tok):
    path, rows, ids, short_max, long_min = prompt_files(tmp_path, tok)
    ds = load_prompts([path], tok, prompt_key="prompt", max_prompt_length=short_max, filter_overlong=True,
                      source_key="data.train_files")
    assert len(ds) == 4 and ds.dropped_overlong == 2
    assert ds.stats["longest_prompt"] == max(len(i) for i in ids)
    for ex, i in zip(ds.examples, (0, 2, 3, 5)):
        assert ex.input_ids == ids[i]
        assert ex.text == f"<|im_start|>user\n{rows[i]['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
        assert ex.data_source == "test/arith"
        assert ex.ground_truth == rows[i]["reward_model"]["ground_truth"]
        assert ex.extra_info == rows[i]["extra_info"]

    everything = load_prompts([path], tok, prompt_key="prompt", max_prompt_length=long_min + 100,
                              filter_overlong=False, source_key="data.train_files")
    assert len(everything) == 6 and everything.dropped_overlong == 0
    assert [e.input_ids for e in everything.examples] == ids


def test_load_prompts_overlong_without_filter_raises(tmp_path, tok):
    path, _, _, short_max, _ = prompt_files(tmp_path, tok)
    with pytest.raises(UserError, match=r"data.train_files: 2 prompts are longer") as info:
        load_prompts([path], tok, prompt_key="prompt", max_prompt_length=short_max, filter_overlong=False,
                     source_key="data.train_files")
    assert "rows [1, 4]" in info.value.message and "filter_overlong_prompts" in info.value.hint
    with pytest.raises(UserError, match="every prompt is longer"):
        load_prompts([path], tok, prompt_key="prompt", max_prompt_length=3, filter_overlong=True,
                     source_key="data.train_files")


def test_load_prompts_validates_and_uses_prompt_key(tmp_path, tok):
    bad = write_parquet(tmp_path / "bad.parquet", [row(), row(data_source="")])
    with pytest.raises(UserError, match=r"row 1: missing 'data_source'"):
        load_prompts([bad], tok, prompt_key="prompt", max_prompt_length=100, filter_overlong=True,
                     source_key="data.train_files")
    question = write_parquet(tmp_path / "q.parquet", [row(question="plain text")])
    ds = load_prompts([question], tok, prompt_key="question", max_prompt_length=100, filter_overlong=True,
                      source_key="data.train_files")
    assert ds.examples[0].text == "<|im_start|>user\nplain text<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------
# PromptLoader
def dataset(n: int = 10) -> PromptDataset:
    return PromptDataset([PromptExample([i + 3], str(i), "src", str(i), {"i": i}) for i in range(n)])


def ids_of(batch: list[PromptExample]) -> list[int]:
    return [e.extra_info["i"] for e in batch]


def epochs(loader: PromptLoader, count: int) -> list[list[list[int]]]:
    out = []
    for _ in range(count):
        out.append([ids_of(b) for b in loader])
        loader.next_epoch()
    return out


def test_loader_is_deterministic_per_seed_and_epochs_differ():
    a = epochs(PromptLoader(dataset(), 3, shuffle=True, seed=7), 3)
    b = epochs(PromptLoader(dataset(), 3, shuffle=True, seed=7), 3)
    assert a == b
    assert len(a[0]) == 3  # 10 // 3, the last partial batch dropped
    for epoch in a:
        seen = [i for batch in epoch for i in batch]
        assert len(set(seen)) == 9 and set(seen) <= set(range(10))
    assert a[0] != a[1] and a[1] != a[2]
    assert epochs(PromptLoader(dataset(), 3, shuffle=True, seed=8), 1)[0] != a[0]
    # Without shuffling every epoch is in file order; drop_last=False keeps the short batch.
    plain = epochs(PromptLoader(dataset(), 3, shuffle=False, seed=7, drop_last=False), 2)
    assert plain[0] == plain[1] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_loader_resume_gives_exactly_the_remaining_batches():
    reference = PromptLoader(dataset(), 3, shuffle=True, seed=1)
    full = epochs(reference, 3)
    flat = [b for e in full for b in e]

    for taken in range(len(flat) + 1):
        run = PromptLoader(dataset(), 3, shuffle=True, seed=1)
        got = []
        while len(got) < taken:  # take `taken` batches, moving to the next epoch as a trainer would
            for batch in run:
                got.append(ids_of(batch))
                if len(got) == taken:
                    break
            else:
                run.next_epoch()
        state = run.state_dict()
        resumed = PromptLoader(dataset(), 3, shuffle=True, seed=1)
        resumed.load_state_dict(dict(state))
        rest = []
        while len(got) + len(rest) < len(flat):
            rest.extend(ids_of(b) for b in resumed)
            resumed.next_epoch()
        assert got + rest == flat, taken


def test_loader_needs_a_full_batch():
    with pytest.raises(UserError, match="fewer than"):
        PromptLoader(dataset(2), 3, shuffle=False, seed=0)
    assert PromptLoader(dataset(2), 3, shuffle=False, seed=0, drop_last=False).batches_per_epoch() == 1


# ---------------------------------------------------------------------------------------------
# collate
def test_collate_left_pads():
    examples = [PromptExample([5, 6, 7], "a", "s1", "1", {"k": 1}), PromptExample([8], "b", "s2", 2, {}),
                PromptExample([9, 10], "c", "s3", None, {"k": 3})]
    batch = collate(examples, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert batch["prompt_text"] == ["a", "b", "c"]
    assert batch["data_source"] == ["s1", "s2", "s3"]
    assert batch["ground_truth"] == ["1", 2, None]
    assert batch["extra_info"] == [{"k": 1}, {}, {"k": 3}]
    same = collate(examples[:1], pad_token_id=0)
    assert same["attention_mask"].tolist() == [[1, 1, 1]]
