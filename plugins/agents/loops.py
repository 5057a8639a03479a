"""The built-in agent loops: ``single_turn`` (one response per prompt, today's rollouts) and ``tool_call`` (turns
with tool calls in the chat template's format, until an answer or a limit).

Tool-call formats (``agent.format``):

- ``hermes`` (Qwen2.5, Qwen3, Hermes models): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  inside the assistant's turn; text around the calls is allowed.
- ``llama3`` (Llama 3.1 / 3.2 JSON tool calling): the whole turn is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several calls separated by ``;``).
- ``auto``: ``hermes`` when the chat template mentions ``<tool_call>``, ``llama3`` when it has an ``ipython`` role,
  else ``hermes``.

A call that cannot be parsed (bad JSON, no name, arguments that are not an object, an unclosed tag) is never an
error of the run: it becomes a tool turn that says what is wrong, and counts in ``agent/malformed_calls``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import Component, hookimpl
from rlx.protocols import ToolCall, ToolResult

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


class SingleTurnOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCallOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["auto", "hermes", "llama3"] = Field(
        "auto", description="Tool-call syntax: hermes (Qwen2.5/Qwen3: <tool_call>{json}</tool_call>), llama3 (the "
        "turn is a JSON call), auto (from the chat template).")


def _call_of(obj: Any, params_key: str) -> ToolCall | ToolResult:
    if not isinstance(obj, dict):
        return ToolResult("?", "Error: a tool call must be a JSON object with \"name\" and "
                          f"\"{params_key}\"; got {type(obj).__name__}.", "malformed")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolResult("?", "Error: the tool call has no \"name\" (a string).", "malformed")
    args = obj.get(params_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolResult(name, f"Error: the arguments of {name!r} are not valid JSON ({exc.msg}).", "malformed")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolResult(name, f"Error: the arguments of {name!r} must be a JSON object; got "
                          f"{type(args).__name__}.", "malformed")
    call_id = obj.get("id")
    return ToolCall(name, args, call_id if isinstance(call_id, str) else None)


def _loads(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, exc.msg
    except RecursionError:
        return None, "nested too deeply"


def parse_hermes(text: str) -> list[ToolCall | ToolResult]:
    """The calls in a hermes-format turn (empty: the turn is an answer); unparsable ones as error results."""
    calls: list[ToolCall | ToolResult] = []
    for body in _HERMES.findall(text):
        obj, err = _loads(body.strip())
        calls.append(_call_of(obj, "arguments") if err is None else
                     ToolResult("?", f"Error: the tool call is not valid JSON ({err}); write "
                                "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.", "malformed"))
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest:
        calls.append(ToolResult("?", "Error: a <tool_call> was opened and not closed with </tool_call>.",
                                "malformed"))
    return calls


def parse_llama3(text: str) -> list[ToolCall | ToolResult]:
    """The calls of a Llama 3 JSON tool-calling turn: the turn (after ``<|python_tag|>``) is one JSON object, or
    several separated by ``;``; a turn that does not start with ``{`` is an answer."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return []
    obj, err = _loads(body)
    if err is None:
        return [_call_of(obj, "parameters")]
    calls: list[ToolCall | ToolResult] = []
    for part in body.split(";"):
        if not part.strip():
            continue
        obj, err = _loads(part.strip())
        calls.append(_call_of(obj, "parameters") if err is None else
                     ToolResult("?", f"Error: the tool call is not valid JSON ({err}); write "
                                "{\"name\": ..., \"parameters\": {...}}.", "malformed"))
    return calls


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3}


def detect_format(tokenizer: Any) -> str:
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "<tool_call>" in template:
        return "hermes"
    if "ipython" in template or _PYTHON_TAG in template:
        return "llama3"
    return "hermes"


class SingleTurn:
    """One response per prompt: the engine's answer is the episode."""

    async def run(self, episode: Any) -> None:
        await episode.generate()


class ToolCallLoop:
    """Turn after turn: the model writes; the calls it made run and their results come back as tool turns; the
    episode ends with a turn without calls (the answer), at ``agent.max_turns`` turns (a turn that still calls a
    tool then ends it unanswered), or when the token budget is spent.

    With an interaction on (``agent.interactions``), an answer goes to it instead of ending the episode: its reply
    is the next user turn, until it ends the episode (``answer``) or the turn limit does (``max_turns``: as in verl,
    the last turn the limit allows is not shown to the interaction)."""

    def __init__(self, fmt: str) -> None:
        self.format = fmt
        self.parse = PARSERS[fmt]

    async def run(self, episode: Any) -> None:
        while True:
            turn = await episode.generate()
            if turn.finish != "stop":
                return
            calls = self.parse(turn.text)
            if not calls:
                if not getattr(episode, "has_interaction", False):
                    return  # an answer
                if episode.turns >= episode.limits.max_turns:
                    episode.end = "max_turns"
                    return
                reply = await episode.interact()
                if reply.done or episode.done:
                    return
                continue
            if episode.turns >= episode.limits.max_turns:
                episode.end = "max_turns"
                return
            results = await episode.call_tools(calls)
            messages = []
            for r in results:
                msg: dict[str, Any] = {"role": "tool", "name": r.name, "content": r.content}
                if r.id is not None:
                    msg["tool_call_id"] = r.id
                messages.append(msg)
            episode.append_messages(messages)
            if episode.done:
                return


def build_single_turn(options: SingleTurnOptions | None, ctx: Any) -> SingleTurn:
    return SingleTurn()


def build_tool_call(options: ToolCallOptions | None, ctx: Any) -> ToolCallLoop:
    opts = options or ToolCallOptions()
    fmt = opts.format
    if fmt == "auto":
        fmt = detect_format(getattr(ctx, "tokenizer", None))
    return ToolCallLoop(fmt)


@hookimpl
def rlx_agent_loops() -> list[Component]:
    return [
        Component(kind="agent_loop", name="single_turn", factory=build_single_turn, config_model=SingleTurnOptions,
                  summary="One response per prompt (the default): the engine is called directly.",
                  extra={"single_turn": True}),
        Component(kind="agent_loop", name="tool_call", factory=build_tool_call, config_model=ToolCallOptions,
                  summary="Multi-turn with tool calls (hermes/Qwen or Llama 3 format) and interactions; tool output "
                          "and user turns are not trained."),
    ]


@hookimpl
def rlx_interactions() -> list[Component]:
    from rlx.plugins.agents.interactions import components

    return components()
