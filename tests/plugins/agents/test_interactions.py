"""Interactions (a simulated user that answers each model turn): the built-in gsm8k interaction on hand-made
conversations, and episodes with an interaction driven through rlx.agent.EpisodeRunner by a scripted engine (the
user turns in the sequence and masked out of the loss, the turn scores, the turn limit, the row picking its
interaction), plus the config checks."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from rlx.agent import AgentLimits, EpisodeRunner, episode_metrics, render_after_turn
from rlx.batch import Batch
from rlx.config import build_raw
from rlx.errors import ConfigError, UserError
from rlx.plugins.agents.interactions import Gsm8kInteraction, Gsm8kInteractionOptions
from rlx.plugins.agents.loops import ToolCallLoop
from rlx.plugins.testing import ScriptedEngine, agent_tokenizer, prompt_batch
from rlx.protocols import InteractionReply, SamplingParams
from rlx.registry import get_plugin_manager
from rlx.validate import resolve

WRONG = Gsm8kInteractionOptions().incorrect_message


def gsm8k(**options: Any) -> Gsm8kInteraction:
    return Gsm8kInteraction(Gsm8kInteractionOptions(**options))


def turns(*contents: str) -> list[dict[str, Any]]:
    """A conversation after the prompt: assistant turns, each followed by the interaction's user turn."""
    out: list[dict[str, Any]] = []
    for i, c in enumerate(contents):
        if i:
            out.append({"role": "user", "content": WRONG})
        out.append({"role": "assistant", "content": c})
    return out


# -- the gsm8k interaction ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("answer, truth, right", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7", True),
    ("#### 1,234", "1234", True),
    ("#### -5", "-5", True),
    ("#### 18.00", "18", True),  # the same number (verl compares the text: 18.00 is not 18 there)
    ("#### $72", "... so she pays 60 + 12 = 72.\n#### 72", True),  # a whole GSM8K solution as the truth
    ("#### 6", "7", False),
    ("The answer is 7.", "7", False),  # strict: no '####', no answer
    ("#### 7 ... no wait, #### 8", "7", False),  # the last marker counts
    ("#### seven", "7", False),
])
def test_gsm8k_checks_the_number_after_the_last_marker(answer: str, truth: str, right: bool) -> None:
    reply = gsm8k().respond(turns(answer), {"ground_truth": truth})
    assert (reply.done, reply.score) == ((True, 1.0) if right else (False, 0.0))
    if not right:
        assert reply.content == WRONG and "again" in reply.content


def test_gsm8k_reads_the_last_assistant_turn_only() -> None:
    g = gsm8k()
    assert not g.respond(turns("#### 7", "#### 9"), {"ground_truth": "7"}).done  # right before, wrong now
    assert g.respond(turns("#### 9", "#### 7"), {"ground_truth": "7"}).done
    assert not g.respond([], {"ground_truth": "7"}).done  # no assistant turn: no answer


def test_gsm8k_flexible_takes_the_last_number_and_the_message_is_an_option() -> None:
    g = gsm8k(method="flexible", incorrect_message="No.")
    assert g.respond(turns("3 + 4 = 7"), {"ground_truth": 7}).done
    reply = g.respond(turns("3 + 4 = 8"), {"ground_truth": 7})
    assert (reply.done, reply.content) == (False, "No.")


@pytest.mark.parametrize("truth", [None, "", "seven", True])
def test_gsm8k_without_a_number_to_compare_with_is_a_user_error(truth: Any) -> None:
    with pytest.raises(UserError, match="no number to compare with"):
        gsm8k().respond(turns("#### 7"), {"ground_truth": truth})


# -- episodes with an interaction -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok() -> Any:
    return agent_tokenizer('{"name": "add", "arguments": {"a": 2}} user assistant tool_response #### That answer '
                           "is not right. Check your reasoning and give your answer again.")


def rows(tok: Any, n: int, extra: list[dict[str, Any]] | None = None, truth: str = "7") -> Batch:
    batch = prompt_batch(tok, [f"What is 3+4? ({i})" for i in range(n)], truth)
    batch.non_tensors["extra_info"] = extra if extra is not None else [{"index": i} for i in range(n)]
    return batch


def runner(tok: Any, engine: ScriptedEngine, interactions: dict[str, Any], tools: dict[str, Any] | None = None,
           **limits: Any) -> EpisodeRunner:
    return EpisodeRunner(ToolCallLoop("hermes"), tools or {}, tok, AgentLimits(**limits), engine.generate,
                         interactions=interactions)


def wrong_then_right(context: str) -> str:
    """The model's turn: 8 at first, 7 once the user said it was wrong."""
    return "#### 7" if "not right" in context else "#### 8"


def test_a_wrong_answer_gets_a_user_turn_that_is_read_not_trained_and_a_right_one_ends_it(tok: Any) -> None:
    engine = ScriptedEngine(tok, wrong_then_right)
    out = runner(tok, engine, {"gsm8k": gsm8k()}).run(rows(tok, 2), SamplingParams(n=2, max_tokens=300))
    assert engine.calls == [4, 4]
    first = tok("#### 8", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    user = render_after_turn(tok, [{"role": "user", "content": WRONG}], None)
    assert tok.decode(user).startswith(f"\n<|im_start|>user\n{WRONG}<|im_end|>")
    second = tok("#### 7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for i in range(4):
        n = int(out["response_mask"][i].sum())
        assert out["responses"][i, :n].tolist() == first + user + second  # "Correct." is not appended
        assert out["loss_mask"][i, :n].tolist() == [1] * len(first) + [0] * len(user) + [1] * len(second)
        assert out["rollout_log_probs"][i, len(first):len(first) + len(user)].abs().sum() == 0
        assert out["messages"][i] == [{"role": "assistant", "content": "#### 8"},
                                      {"role": "user", "content": WRONG},
                                      {"role": "assistant", "content": "#### 7"}]
        assert out["extra_info"][i] == {"index": i // 2, "turn_scores": [0.0, 1.0]}  # the reward reads them
    m = episode_metrics(out)
    assert m["agent/turns/mean"] == 2 and m["agent/interaction_turns/mean"] == 2
    assert m["agent/turn_score/mean"] == 0.5 and m["agent/end/answer"] == 1.0
    assert m["agent/masked_token_share"] == pytest.approx(len(user) / (len(first) + len(user) + len(second)))


def test_the_turn_limit_ends_it_and_its_last_turn_is_not_shown_to_the_interaction(tok: Any) -> None:
    seen: list[int] = []

    class Counting(Gsm8kInteraction):
        def respond(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> InteractionReply:
            seen.append(len(messages))
            return super().respond(messages, kwargs)

    engine = ScriptedEngine(tok, lambda c: "#### 8")
    out = runner(tok, engine, {"gsm8k": Counting(Gsm8kInteractionOptions())}, max_turns=3).run(
        rows(tok, 1), SamplingParams(n=1, max_tokens=400))
    assert seen == [1, 3]  # after turns 1 and 2; turn 3 is the last the limit allows (verl's order)
    assert [m["role"] for m in out["messages"][0]] == ["assistant", "user", "assistant", "user", "assistant"]
    assert out["extra_info"][0]["turn_scores"] == [0.0, 0.0]
    m = episode_metrics(out)
    assert m["agent/end/max_turns"] == 1.0 and m["agent/turns/max"] == 3


def test_the_token_budget_cuts_a_user_turn_and_ends_the_episode(tok: Any) -> None:
    engine = ScriptedEngine(tok, lambda c: "#### 8")
    first = len(tok("#### 8", add_special_tokens=False)["input_ids"]) + 1
    out = runner(tok, engine, {"gsm8k": gsm8k()}).run(rows(tok, 1), SamplingParams(n=1, max_tokens=first + 5))
    assert int(out["response_mask"][0].sum()) == first + 5 and out["loss_mask"][0, first:].sum() == 0
    assert episode_metrics(out)["agent/end/budget"] == 1.0 and engine.calls == [1]


def test_tool_calls_go_to_the_tools_and_answers_to_the_interaction(tok: Any) -> None:
    class Add:
        def schema(self) -> dict[str, Any]:
            return {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}

        def __call__(self, arguments: dict[str, Any]) -> str:
            return str(arguments["a"] + arguments["b"])

    def model(context: str) -> str:
        if "<tool_response>" not in context:
            return '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 5}}\n</tool_call>'
        return wrong_then_right(context)

    out = runner(tok, ScriptedEngine(tok, model), {"gsm8k": gsm8k()}, {"add": Add()}).run(
        rows(tok, 1), SamplingParams(n=1, max_tokens=500))
    assert [m["role"] for m in out["messages"][0]] == ["assistant", "tool", "assistant", "user", "assistant"]
    assert out["extra_info"][0]["turn_scores"] == [0.0, 1.0]
    m = episode_metrics(out)
    assert m["agent/tool_calls/mean"] == 1 and m["agent/interaction_turns/mean"] == 2


class Echo:
    """Replies with its name and the kwargs it got; ends the episode at once."""

    def __init__(self, name: str) -> None:
        self.name = name

    def respond(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> InteractionReply:
        return InteractionReply(f"{self.name}:{kwargs.get('ground_truth')}", 0.5, True)


def test_the_row_picks_its_interaction_by_name_with_its_own_ground_truth(tok: Any) -> None:
    extra = [{"interaction_kwargs": {"name": "b", "ground_truth": "9", "query": "q"}},
             {"interaction_kwargs": {"name": "a"}}]
    seen: list[tuple[str, Any]] = []

    class Recording(Echo):
        def respond(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> InteractionReply:
            seen.append((self.name, kwargs))
            return super().respond(messages, kwargs)

    engine = ScriptedEngine(tok, lambda c: "#### 7")
    out = runner(tok, engine, {"a": Recording("a"), "b": Recording("b")}).run(rows(tok, 2, extra),
                                                                              SamplingParams(n=1, max_tokens=100))
    assert sorted(seen, key=lambda s: s[0]) == [("a", {"name": "a", "ground_truth": "7"}),
                                                 ("b", {"name": "b", "ground_truth": "9", "query": "q"})]
    assert [e["turn_scores"] for e in out["extra_info"]] == [[0.5], [0.5]]
    assert extra[0] == {"interaction_kwargs": {"name": "b", "ground_truth": "9", "query": "q"}}  # data unchanged


@pytest.mark.parametrize("extra, interactions, expect", [
    ([{"interaction_kwargs": {"name": "weather"}}], ["gsm8k"], "interaction 'weather'"),
    ([{}], ["a", "b"], "names no interaction"),
    ([{"interaction_kwargs": "gsm8k"}], ["gsm8k"], "not a mapping"),
])
def test_a_row_whose_interaction_is_not_on_is_a_user_error(tok: Any, extra: list[dict[str, Any]],
                                                           interactions: list[str], expect: str) -> None:
    engine = ScriptedEngine(tok, lambda c: "#### 7")
    with pytest.raises(UserError, match=expect):
        runner(tok, engine, {n: Echo(n) for n in interactions}).run(rows(tok, 1, extra),
                                                                    SamplingParams(n=1, max_tokens=100))


def test_an_async_interaction_with_state_per_episode(tok: Any) -> None:
    """``for_episode`` gives each episode its own object (verl's start_interaction); ``async def respond`` is
    awaited. This one lets the model try twice, then ends the episode with the score of the tries."""
    made: list[dict[str, Any]] = []

    class Patient:
        def __init__(self, tries: int = 0) -> None:
            self.tries = tries

        def for_episode(self, kwargs: dict[str, Any]) -> Patient:
            made.append(kwargs)
            return Patient()

        async def respond(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> InteractionReply:
            await asyncio.sleep(0)
            self.tries += 1
            return InteractionReply(f"try {self.tries}", float(self.tries), self.tries == 2)

    engine = ScriptedEngine(tok, lambda c: "#### " + str(len(re.findall("try", c))))
    out = runner(tok, engine, {"p": Patient()}).run(rows(tok, 2), SamplingParams(n=2, max_tokens=300))
    assert len(made) == 4  # one per episode
    assert all(e["turn_scores"] == [1.0, 2.0] for e in out["extra_info"])
    assert out["messages"][0] == [{"role": "assistant", "content": "#### 0"}, {"role": "user", "content": "try 1"},
                                  {"role": "assistant", "content": "#### 1"}]


@pytest.mark.parametrize("reply, expect", [
    ("correct", "not an rlx.protocols.InteractionReply"),
    (InteractionReply(3, 1.0), "content of type int"),  # type: ignore[arg-type]
    (InteractionReply("ok", float("nan")), "a finite number or None"),
])
def test_a_malformed_reply_fails_the_run_naming_the_interaction(tok: Any, reply: Any, expect: str) -> None:
    class Bad:
        def respond(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> Any:
            return reply

    engine = ScriptedEngine(tok, lambda c: "#### 7")
    with pytest.raises(RuntimeError, match=f"interaction 'bad'.*{re.escape(expect)}|{re.escape(expect)}"):
        runner(tok, engine, {"bad": Bad()}).run(rows(tok, 1), SamplingParams(n=1, max_tokens=100))


# -- the config --------------------------------------------------------------------------------------------------
def problems(*overrides: str) -> list[str]:
    raw = build_raw(preset="tiny_tools", overrides=list(overrides))
    with pytest.raises(ConfigError) as info:
        resolve(raw, get_plugin_manager(), check_files=False)
    return info.value.problems


def test_an_interaction_with_the_tool_call_loop_and_no_tools_validates() -> None:
    raw = build_raw(preset="tiny_tools", overrides=["agent.tools=[]", "agent.interactions=[gsm8k]",
                                                    "interactions.gsm8k.method=flexible"])
    resolved = resolve(raw, get_plugin_manager(), check_files=False)
    assert resolved.config.agent.interactions == ["gsm8k"]
    assert resolved.as_dict()["interactions"]["gsm8k"]["method"] == "flexible"


@pytest.mark.parametrize("overrides, expect", [
    (["agent.name=single_turn", "agent.tools=[]", "agent.interactions=[gsm8k]"],
     "agent.interactions: agent loop 'single_turn' answers once"),
    (["agent.interactions=[gsm8k_user]"], "agent.interactions: No interaction named 'gsm8k_user'"),
    (["agent.interactions=[gsm8k]", "interactions.gsm8k.method=loose"], "interactions.gsm8k.method"),
    (["interactions.gsm8k.method=strict"], "interactions.gsm8k: options for an interaction that is not on"),
    (["agent.tools=[]"], "no tools to call and no interaction"),
])
def test_interaction_config_errors(overrides: list[str], expect: str) -> None:
    found = problems(*overrides)
    assert any(expect in p for p in found), found
