"""The ``check_once`` agent loop: tool calls as in rlx's ``tool_call`` loop, then one self-check.

The model writes a turn; the calls in it run (``episode.call_tools``) and their results come back as tool turns
(``episode.append_messages``). The first turn without calls is the model's first answer: instead of ending the
episode, the loop appends one user turn, ``check_prompt`` ("Check your answer once more; reply with the final
answer only."), and the model answers again (it may call tools again first). The second answer ends the episode;
the check prompt is never appended twice.

Limits: every turn goes through ``episode.generate()``, which generates nothing past ``agent.max_turns`` turns
or the token budget; a first answer given in the last turn allowed ends the episode unchecked (its check could
never be answered), a turn that still calls tools then ends it unanswered (``agent/end/max_turns``), and a
turn, tool output or check prompt cut by the token budget ends it (``episode.done``).

Tool-call syntax (``agent.format``): ``hermes``, ``llama3`` or ``auto``; the parsing is rlx's own
(``rlx.plugins.agents.loops.PARSERS`` and ``detect_format``, shipped with rlx), so this loop reads calls exactly
as the built-in ``tool_call`` loop does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx.plugins.agents.loops import PARSERS, detect_format
from rlx.protocols import ToolCall, ToolResult

if TYPE_CHECKING:
    from rlx.agent import Episode

CHECK_PROMPT = "Check your answer once more; reply with the final answer only."


class CheckOnceOptions(BaseModel):
    """The ``agent`` section's keys besides rlx's own (``agent.check_prompt``, ``agent.format``)."""

    model_config = ConfigDict(extra="forbid")
    check_prompt: str = Field(CHECK_PROMPT, min_length=1, max_length=2000,
                              description="The user turn appended after the model's first answer.")
    format: Literal["auto", "hermes", "llama3"] = Field(
        "auto", description="Tool-call syntax: hermes (Qwen2.5/Qwen3: <tool_call>{json}</tool_call>), llama3 (the "
        "turn is a JSON call), auto (from the chat template).")


class CheckOnce:
    """An :class:`rlx.protocols.AgentLoop`: see the module docstring."""

    def __init__(self, fmt: str, check_prompt: str = CHECK_PROMPT) -> None:
        self.format = fmt
        self.parse = PARSERS[fmt]
        self.check_prompt = check_prompt

    async def run(self, episode: Episode) -> None:
        checked = False
        while True:
            turn = await episode.generate()
            if turn.finish != "stop":  # cut by the token budget, or nothing generated (a limit): the end
                return
            calls: list[ToolCall | ToolResult] = self.parse(turn.text)
            last_turn = episode.turns >= episode.limits.max_turns
            if not calls:  # an answer
                if checked or last_turn:
                    return
                checked = True
                episode.append_messages([{"role": "user", "content": self.check_prompt}])
            else:
                if last_turn:  # its results could never be read
                    episode.end = "max_turns"
                    return
                results = await episode.call_tools(calls)
                episode.append_messages([_tool_message(r) for r in results])
            if episode.done:
                return


def _tool_message(result: ToolResult) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "tool", "name": result.name, "content": result.content}
    if result.id is not None:
        msg["tool_call_id"] = result.id
    return msg


def build_check_once(options: CheckOnceOptions | None, ctx: Any) -> CheckOnce:
    opts = options or CheckOnceOptions()
    fmt = opts.format
    if fmt == "auto":
        fmt = detect_format(getattr(ctx, "tokenizer", None))
    return CheckOnce(fmt, opts.check_prompt)
