"""The episode runner (rlx.agent) and the built-in agent loops, driven by a scripted engine: what the model says
each turn is a function of the conversation so far, so every path (tool calls, malformed calls, a tool that
hangs or prints 10 MB, the turn limit, the token budget, an episode that never answers) is reached on purpose.
The tokenizer is a real byte-level BPE with a Qwen2.5-shaped chat template; the tools are real components."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch

from rlx.agent import AgentLimits, EpisodeRunner, episode_metrics, render_after_turn, truncate
from rlx.batch import Batch, trained_mask
from rlx.plugins.agents.loops import ToolCallLoop, parse_hermes, parse_llama3
from rlx.plugins.testing import ScriptedEngine, agent_tokenizer, prompt_batch
from rlx.protocols import SamplingParams, ToolCall, ToolError, ToolResult


@pytest.fixture(scope="module")
def tok() -> Any:
    return agent_tokenizer('{"name": "add", "arguments": {"a": 2}} user assistant tool_response')


class Add:
    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}

    def __call__(self, arguments: dict[str, Any]) -> str:
        if not isinstance(arguments.get("a"), int) or not isinstance(arguments.get("b"), int):
            raise ToolError("a and b must be integers")
        return str(arguments["a"] + arguments["b"])


class Hang(Add):
    def __call__(self, arguments: dict[str, Any]) -> str:
        time.sleep(30)
        return "never"


class Flood(Add):
    def __call__(self, arguments: dict[str, Any]) -> str:
        return "x" * 10_000_000


class Crash(Add):
    def __call__(self, arguments: dict[str, Any]) -> str:
        raise KeyError("boom")


def prompts(tok: Any, questions: list[str]) -> Batch:
    return prompt_batch(tok, questions, "5")


def runner(tok: Any, engine: ScriptedEngine, tools: dict[str, Any] | None = None, **limits: Any) -> EpisodeRunner:
    return EpisodeRunner(ToolCallLoop("hermes"), {"add": Add()} if tools is None else tools, tok,
                         AgentLimits(**limits), engine.generate)


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def add_then_answer(context: str) -> str:
    m = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.DOTALL)
    return f"The answer is {m[-1]}." if m else CALL


def test_an_episode_calls_a_tool_and_answers_with_tool_tokens_masked_out(tok: Any) -> None:
    engine = ScriptedEngine(tok, add_then_answer)
    out = runner(tok, engine).run(prompts(tok, ["What is 2+3?", "And 2+3?"]), SamplingParams(n=2, max_tokens=200))
    assert len(out) == 4 and engine.calls == [4, 4]  # two turns, each one call for every episode
    tool_turn = render_after_turn(tok, [{"role": "tool", "name": "add", "content": "5"}], None)
    assert tok.decode(tool_turn).startswith("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>")
    call_ids = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    answer_ids = tok("The answer is 5.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for i in range(4):
        n = int(out["response_mask"][i].sum())
        ids, loss = out["responses"][i, :n].tolist(), out["loss_mask"][i, :n].tolist()
        assert ids == call_ids + tool_turn + answer_ids  # one sequence: the call, the tool turn, the answer
        assert loss == [1] * len(call_ids) + [0] * len(tool_turn) + [1] * len(answer_ids)
        lp = out["rollout_log_probs"][i, :n]
        assert torch.equal(lp != 0, torch.tensor(loss, dtype=torch.bool))  # log-probs of the model's tokens only
        assert out["messages"][i] == [{"role": "assistant", "content": CALL},
                                      {"role": "tool", "name": "add", "content": "5"},
                                      {"role": "assistant", "content": "The answer is 5."}]
    assert torch.equal(trained_mask(out), out["response_mask"] * out["loss_mask"])
    m = episode_metrics(out)
    assert m["agent/turns/mean"] == 2 and m["agent/tool_calls/mean"] == 1 and m["agent/tool_errors/mean"] == 0
    assert m["agent/end/answer"] == 1.0
    assert m["agent/masked_token_share"] == pytest.approx(len(tool_turn) / (len(call_ids) + len(tool_turn)
                                                                             + len(answer_ids)))
    assert out["ground_truth"] == ["5"] * 4


@pytest.mark.parametrize("reply, expect", [
    ('<tool_call>{"name": "add", "arguments": {a: 2}}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}', "not closed"),
    ('<tool_call>{"arguments": {"a": 2}}</tool_call>', "no \"name\""),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>["add"]</tool_call>', "must be a JSON object"),
])
def test_a_malformed_call_becomes_an_error_turn(tok: Any, reply: str, expect: str) -> None:
    engine = ScriptedEngine(tok, lambda c: reply if "<tool_response>" not in c else "5")
    out = runner(tok, engine).run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=300))
    tool = out["messages"][0][1]
    assert tool["role"] == "tool" and expect in tool["content"] and tool["content"].startswith("Error")
    assert out["messages"][0][-1] == {"role": "assistant", "content": "5"}  # the episode went on to an answer
    m = episode_metrics(out)
    assert m["agent/malformed_calls/mean"] == 1 and m["agent/tool_errors/mean"] == 1 and m["agent/end/answer"] == 1


def test_unknown_tools_bad_arguments_and_a_raising_tool_are_error_turns(tok: Any) -> None:
    calls = ('<tool_call>{"name": "mul", "arguments": {}}</tool_call><tool_call>{"name": "add", "arguments": '
             '{"a": "x"}}</tool_call><tool_call>{"name": "crash", "arguments": {}}</tool_call>')
    engine = ScriptedEngine(tok, lambda c: calls if "<tool_response>" not in c else "done")
    out = runner(tok, engine, {"add": Add(), "crash": Crash()}).run(prompts(tok, ["q"]),
                                                                    SamplingParams(n=1, max_tokens=400))
    results = [m["content"] for m in out["messages"][0] if m["role"] == "tool"]
    assert "no tool named 'mul'" in results[0] and "add, crash" in results[0]
    assert results[1] == "Error: a and b must be integers"
    assert results[2].startswith("Error: KeyError")
    m = episode_metrics(out)
    assert m["agent/tool_calls/mean"] == 3 and m["agent/tool_errors/mean"] == 3


def test_a_tool_that_hangs_returns_an_error_turn_within_its_timeout(tok: Any) -> None:
    engine = ScriptedEngine(tok, add_then_answer)
    start = time.perf_counter()
    out = runner(tok, engine, {"add": Hang()}, tool_timeout_s=0.5).run(prompts(tok, ["q", "r"]),
                                                                      SamplingParams(n=1, max_tokens=300))
    assert time.perf_counter() - start < 5
    assert "did not answer within 0.5 s" in out["messages"][0][1]["content"]
    m = episode_metrics(out)
    assert m["agent/tool_timeouts/mean"] == 1 and m["agent/tool_errors/mean"] == 0


def test_a_tool_that_prints_10_mb_is_cut_to_the_limit(tok: Any) -> None:
    engine = ScriptedEngine(tok, add_then_answer)
    start = time.perf_counter()
    out = runner(tok, engine, {"add": Flood()}, max_tool_response_length=100).run(
        prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=500))
    assert time.perf_counter() - start < 10
    content = out["messages"][0][1]["content"]
    assert len(content) == 100 and content.startswith("x") and content.endswith("x") and "truncated" in content


def test_the_turn_limit_ends_an_episode_that_never_answers(tok: Any) -> None:
    engine = ScriptedEngine(tok, lambda c: CALL)  # calls a tool every turn
    out = runner(tok, engine, max_turns=3).run(prompts(tok, ["q", "r"]), SamplingParams(n=1, max_tokens=2000))
    m = episode_metrics(out)
    assert m["agent/turns/max"] == 3 and m["agent/end/max_turns"] == 1.0
    assert m["agent/tool_calls/mean"] == 2  # the third turn's call is not run: its result would never be read
    assert out["messages"][0][-1]["role"] == "assistant"
    assert engine.calls == [2, 2, 2]


def test_the_token_budget_ends_an_episode_and_is_never_exceeded(tok: Any) -> None:
    engine = ScriptedEngine(tok, lambda c: CALL)
    for budget in (5, 40, 60, 90):
        out = runner(tok, engine, max_turns=50).run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=budget))
        assert int(out["response_mask"].sum()) <= budget
        assert episode_metrics(out)["agent/end/budget"] == 1.0
    # A model that never ends its turn: the turn runs to the budget and the episode ends there.
    engine = ScriptedEngine(tok, lambda c: "la", stop=False)
    out = runner(tok, engine).run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=30))
    assert int(out["response_mask"].sum()) == 30 and int(out["loss_mask"].sum()) == 30
    assert episode_metrics(out)["agent/end/budget"] == 1.0


def test_finished_episodes_free_their_rows_in_later_engine_calls(tok: Any) -> None:
    # Prompts asking for k tool rounds: the engine's batch shrinks as episodes finish.
    def reply(context: str) -> str:
        want = int(re.search(r"rounds (\d)", context).group(1))
        return CALL if context.count("<tool_response>") < want else "ok"

    engine = ScriptedEngine(tok, reply)
    out = runner(tok, engine, max_turns=8).run(prompts(tok, [f"rounds {k}" for k in (0, 1, 2, 3)]),
                                               SamplingParams(n=1, max_tokens=1000))
    assert engine.calls == [4, 3, 2, 1]
    assert out["agent/turns"].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_an_agent_loop_that_raises_names_itself(tok: Any) -> None:
    class Broken:
        async def run(self, episode: Any) -> None:
            await episode.generate()
            raise ValueError("bad loop")

    engine = ScriptedEngine(tok, lambda c: "hi")
    r = EpisodeRunner(Broken(), {}, tok, AgentLimits(), engine.generate, "agent_loop 'broken'")
    with pytest.raises(RuntimeError, match="agent_loop 'broken' failed in episode 0 after 1 turn"):
        r.run(prompts(tok, ["q"]), SamplingParams(n=1, max_tokens=20))


def test_parsers() -> None:
    calls = parse_hermes('I will add. <tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call> and '
                         '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "c1"}</tool_call>')
    assert calls == [ToolCall("add", {"a": 1}), ToolCall("add", {"a": 2, "b": 3}, "c1")]
    assert parse_hermes("The answer is 5.") == []
    assert parse_llama3('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}') == [
        ToolCall("add", {"a": 1, "b": 2})]
    assert parse_llama3('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}') == [
        ToolCall("a", {}), ToolCall("b", {})]
    assert parse_llama3("It is 3.") == []
    bad = parse_llama3('{"name": "a", "parameters": {')
    assert len(bad) == 1 and isinstance(bad[0], ToolResult) and bad[0].error == "malformed"
    deep = parse_hermes("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert isinstance(deep[0], ToolResult) and deep[0].error == "malformed"


def test_truncate_sides() -> None:
    text = "a" * 50 + "b" * 50
    assert truncate(text, 200, "middle") == text
    for side in ("left", "middle", "right"):
        assert len(truncate(text, 40, side)) == 40
    assert truncate(text, 40, "left").startswith("a") and truncate(text, 40, "right").endswith("b")
    assert truncate(text, 40, "left") == "a" * 23 + "...(truncated)..."
    assert truncate(text, 40, "right") == "...(truncated)..." + "b" * 23
    mid = truncate(text, 40, "middle")
    assert mid.startswith("a") and mid.endswith("b")


def test_tool_tokens_get_no_gradient_in_the_actor_loss(tok: Any) -> None:
    """The actor loss of a batch of episodes: its gradient w.r.t. the log-probs of tool-result tokens is exactly 0,
    and the loss equals that of the same batch with the tool tokens cut out of the response mask."""
    from rlx.plugins.algorithms.base import ActorLoss, AlgorithmOptions
    from rlx.records import LossContext

    engine = ScriptedEngine(tok, add_then_answer)
    out = runner(tok, engine).run(prompts(tok, ["q", "r"]), SamplingParams(n=2, max_tokens=200))
    b, r = out["responses"].shape
    torch.manual_seed(0)
    log_probs = (torch.randn(b, r, dtype=torch.float64) - 1).requires_grad_()
    out.update(old_log_probs=log_probs.detach() + 0.1 * torch.randn(b, r, dtype=torch.float64),
               advantages=torch.randn(b, r, dtype=torch.float64), ref_log_probs=torch.zeros(b, r, dtype=torch.float64))
    opts = AlgorithmOptions(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    mask = trained_mask(out)
    ctx = LossContext(float(mask.sum()), float((mask.sum(-1) > 0).sum()), r, False)
    entropy = torch.rand(b, r, dtype=torch.float64, requires_grad=True)
    loss, _ = ActorLoss(opts)({"log_probs": log_probs, "entropy": entropy}, out, ctx)
    loss.backward()
    tool = (out["response_mask"] == 1) & (out["loss_mask"] == 0)
    assert bool(tool.any())
    assert torch.all(log_probs.grad[tool] == 0) and torch.all(entropy.grad[tool] == 0)
    assert bool((log_probs.grad[mask.bool()] != 0).any())
    # The same loss as a batch whose response mask leaves the tool tokens out.
    cut = Batch(dict(out.tensors), dict(out.non_tensors))
    cut.tensors["response_mask"] = mask
    del cut.tensors["loss_mask"]
    loss_cut, _ = ActorLoss(opts)({"log_probs": log_probs.detach(), "entropy": entropy.detach()}, cut, ctx)
    assert float(loss_cut) == pytest.approx(float(loss.detach()), rel=1e-12)


def test_a_tool_is_bound_to_each_episode_once(tok: Any) -> None:
    """``for_episode(row)``: each episode's calls reach the tool bound to its own row (here, its ground truth)."""
    from rlx.plugins.agents.tools import Gsm8kAnswer

    bound: list[dict[str, Any]] = []

    class Checker(Gsm8kAnswer):
        def for_episode(self, row: dict[str, Any]) -> Gsm8kAnswer:
            bound.append(row)
            return super().for_episode(row)

    answer = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "5"}}</tool_call>'
    engine = ScriptedEngine(tok, lambda c: answer if c.count("<tool_response>") < 2 else "#### 5")
    batch = prompts(tok, ["q", "r"])
    batch.non_tensors["ground_truth"] = ["5", "Three and two... #### 6"]
    out = runner(tok, engine, {"calc_gsm8k_reward": Checker()}).run(batch, SamplingParams(n=1, max_tokens=400))
    assert [r["ground_truth"] for r in bound] == ["5", "Three and two... #### 6"]  # once per episode
    results = [[m["content"] for m in msgs if m["role"] == "tool"] for msgs in out["messages"]]
    assert results == [["Current parsed answer='5' reward=1.0"] * 2, ["Current parsed answer='5' reward=0.0"] * 2]
