"""Multi-turn rollouts: episodes in which the model calls tools, batched into engine calls.

An agent loop (``agent.name``, an ``agent_loop`` plugin, :class:`rlx.protocols.AgentLoop`) drives one episode
as straight-line async code::

    turn = await episode.generate()                 # one assistant turn, appended as the model's tokens
    results = await episode.call_tools(calls)       # the tools run in threads, under their time limit
    episode.append_messages([{"role": "tool", ...}])  # their output, rendered by the chat template, appended

:class:`EpisodeRunner` runs every episode of a batch at once on one event loop. Whenever no episode can move
(each waits for the engine or for a tool), the turns the waiting episodes asked for go to the engine as one
batch (``RolloutEngine.generate`` through the rollout worker group, so every engine and launcher serves
episodes unchanged); an episode whose tools finish while the engine works joins the next call, a finished one
frees its row. The episode's tokens after the prompt become one response: ``response_mask`` is 1 on all of them
(forward passes attend to everything), ``loss_mask`` 1 on the model's own tokens only (tool results are read,
not trained: :func:`rlx.batch.trained_mask`), ``rollout_log_probs`` the engine's log-probs of the model's tokens.
The reward sees the whole transcript and, as ``RewardBatch.messages``, its turns.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from rlx.errors import UserError
from rlx.protocols import Interaction, InteractionReply, SamplingParams, Tool, ToolCall, ToolError, ToolResult

if TYPE_CHECKING:
    import torch

    from rlx.batch import Batch

Finish = Literal["stop", "length", "budget"]
# Why an episode ended (agent/finish/* metrics): its loop returned after an answer, the turn limit, the token
# budget, or a turn cut by its token budget.
END_REASONS = ("answer", "max_turns", "budget")


@dataclass(frozen=True)
class AgentLimits:
    """What every agent loop is held to (the ``agent`` section's core keys)."""

    max_turns: int = 4
    max_tool_calls: int = 4
    max_tool_response_length: int = 256
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    tool_timeout_s: float = 30.0
    max_concurrent_tools: int = 32

    @staticmethod
    def from_config(agent: Any) -> AgentLimits:
        return AgentLimits(max_turns=agent.max_turns, max_tool_calls=agent.max_tool_calls,
                           max_tool_response_length=agent.max_tool_response_length,
                           tool_response_truncate_side=agent.tool_response_truncate_side,
                           tool_timeout_s=agent.tool_timeout_s, max_concurrent_tools=agent.max_concurrent_tools)


@dataclass(frozen=True)
class Turn:
    """One assistant turn: its text (special tokens left out), its tokens, and how it ended: ``stop`` (a stop
    token: the turn is complete), ``length`` (the episode's token budget cut it), ``budget`` (no tokens were left
    for it, or the turn limit was reached: nothing was generated)."""

    text: str
    token_ids: tuple[int, ...]
    finish: Finish


def truncate(text: str, limit: int, side: str) -> str:
    """``text`` cut to at most ``limit`` characters, with a marker where it was cut. ``side`` names the part kept,
    as verl's ``tool_response_truncate_side`` does: ``left`` keeps the start, ``right`` the end, ``middle`` both
    ends."""
    if len(text) <= limit:
        return text
    marker = "...(truncated)..."
    keep = max(limit - len(marker), 0)
    if side == "left":
        return (text[:keep] + marker)[:limit]
    if side == "right":
        return (marker + text[len(text) - keep:])[-limit:]
    head = keep - keep // 2
    return text[:head] + marker + text[len(text) - keep // 2:] if keep // 2 else text[:head] + marker


class Episode:
    """One episode, as its agent loop sees it.

    Read: ``prompt_ids`` (the prompt's tokens), ``row`` (the prompt's data: ``ground_truth``, ``data_source``,
    ``extra_info``, ``prompt_text``), ``tools`` (name -> schema of the tools it may call), ``tokenizer``,
    ``limits`` (:class:`AgentLimits`), ``turns`` (assistant turns so far), ``messages`` (its turns after the
    prompt as chat messages), ``budget_left`` (response tokens left, tool output included).
    """

    def __init__(self, runner: EpisodeRunner, index: int, prompt_ids: list[int], row: dict[str, Any]) -> None:
        self._runner = runner
        self.index = index
        self.prompt_ids = prompt_ids
        self.row = row
        self.tools = {name: tool.schema() for name, tool in runner.tools.items()}
        self.tokenizer = runner.tokenizer
        self.limits = runner.limits
        self.turns = 0
        self.messages: list[dict[str, Any]] = []
        self.ids: list[int] = []  # the response: every token after the prompt
        self.trained: list[int] = []  # 1 on the model's tokens
        self.log_probs: list[float] = []
        self.end: str = "answer"
        self.stats = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "malformed_calls": 0}
        self.turn_scores: list[float] = []  # the interaction's scores of the model's answers, in order
        self._bound: dict[str, Tool | None] = {}
        self._interaction: tuple[str, Interaction, dict[str, Any]] | None = None

    @property
    def budget_left(self) -> int:
        return max(self._runner.max_tokens - len(self.ids), 0)

    async def generate(self) -> Turn:
        """The model's next turn, continuing everything so far. Without tokens left, or past ``limits.max_turns``
        turns, nothing is generated (``finish="budget"``) and the episode ends for that reason."""
        if self.turns >= self.limits.max_turns:
            self.end = "max_turns"
            return Turn("", (), "budget")
        if self.budget_left <= 0:
            self.end = "budget"
            return Turn("", (), "budget")
        ids, log_probs, stopped = await self._runner.request_turn(self)
        self.turns += 1
        self.ids.extend(ids)
        self.trained.extend([1] * len(ids))
        self.log_probs.extend(log_probs)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        finish: Finish = "stop" if stopped else "length"
        if not stopped:
            self.end = "budget"
        return Turn(text, tuple(ids), finish)

    async def call_tools(self, calls: Sequence[ToolCall | ToolResult]) -> list[ToolResult]:
        """Run the calls (several at once) and return one result each, in order; never raises. A
        :class:`ToolResult` in ``calls`` (a call that could not be parsed) is passed through as it is. Calls past
        ``limits.max_tool_calls``, to unknown tools, that raise, or that take longer than
        ``limits.tool_timeout_s`` get an error result; outputs are cut to ``limits.max_tool_response_length``
        characters."""
        results = await asyncio.gather(*(self._one_call(i, c) for i, c in enumerate(calls)))
        for r in results:
            if r.error == "malformed":
                self.stats["malformed_calls"] += 1
            else:
                self.stats["tool_calls"] += 1
            if r.error in ("error", "unknown_tool", "malformed"):
                self.stats["tool_errors"] += 1
            elif r.error == "timeout":
                self.stats["tool_timeouts"] += 1
        return list(results)

    async def _one_call(self, i: int, call: ToolCall | ToolResult) -> ToolResult:
        lim = self.limits
        if isinstance(call, ToolResult):
            return replace(call, content=truncate(call.content, lim.max_tool_response_length,
                                                  lim.tool_response_truncate_side))
        if i >= lim.max_tool_calls:
            return ToolResult(call.name, f"Error: at most {lim.max_tool_calls} tool calls run per turn; this one "
                              "was not run.", "error", call.id)
        tool = self._tool(call.name)
        if tool is None:
            known = ", ".join(sorted(self._runner.tools)) or "none"
            return ToolResult(call.name, f"Error: there is no tool named {call.name!r} (tools: {known}).",
                              "unknown_tool", call.id)
        content, error = await self._runner.run_tool(tool, call)
        return ToolResult(call.name, truncate(content, lim.max_tool_response_length, lim.tool_response_truncate_side),
                          error, call.id)

    def _tool(self, name: str) -> Tool | None:
        """The tool ``name`` for this episode: the built one, or what its ``for_episode(row)`` gave, once."""
        if name in self._bound:
            return self._bound[name]
        tool = self._runner.tools.get(name)
        if tool is not None and callable(getattr(tool, "for_episode", None)):
            tool = tool.for_episode(self.row)  # type: ignore[attr-defined]
        self._bound[name] = tool
        return tool

    @property
    def has_interaction(self) -> bool:
        """Whether an interaction answers this episode's turns (``agent.interactions`` is not empty)."""
        return bool(self._runner.interactions)

    async def interact(self) -> InteractionReply | None:
        """The interaction's reply to the model's last turn (None without ``agent.interactions``): its score is
        recorded (``turn_scores``), and unless it ends the episode its ``content`` is appended as a user turn (not
        trained), followed by the prompt of the model's next turn. The row's ``extra_info.interaction_kwargs.name``
        picks the interaction (the only one on, where the row names none)."""
        if not self._runner.interactions:
            return None
        name, interaction, kwargs = self._bind_interaction()
        messages = [dict(m) for m in self.messages]
        respond = interaction.respond
        if inspect.iscoroutinefunction(respond):
            reply = await respond(messages, dict(kwargs))
        else:
            reply = await asyncio.to_thread(respond, messages, dict(kwargs))
        reply = _checked_reply(reply, name)
        self.stats["interaction_turns"] = self.stats.get("interaction_turns", 0) + 1
        if reply.score is not None:
            self.turn_scores.append(reply.score)
        if not reply.done:
            self.append_messages([{"role": "user", "content": reply.content}])
        return reply

    def _bind_interaction(self) -> tuple[str, Interaction, dict[str, Any]]:
        if self._interaction is not None:
            return self._interaction
        available = self._runner.interactions
        extra = self.row.get("extra_info")
        given = extra.get("interaction_kwargs") if isinstance(extra, dict) else None
        if given is not None and not isinstance(given, dict):
            raise UserError(f"Episode {self.index}: extra_info.interaction_kwargs is a {type(given).__name__}, not a "
                            "mapping.", "Give each row's interaction_kwargs as {name: ..., ground_truth: ...} "
                            "(verl's gsm8k_multiturn_w_interaction data has this shape).")
        kwargs = dict(given or {})
        name = kwargs.get("name")
        if name is None:
            if len(available) != 1:
                raise UserError(f"Episode {self.index}: its row names no interaction "
                                "(extra_info.interaction_kwargs.name) and several are on "
                                f"({', '.join(sorted(available))}).",
                                "Name one in each row, or turn on one interaction (agent.interactions=[NAME]).")
            name = next(iter(available))
        if name not in available:
            raise UserError(f"Episode {self.index}: its row's interaction {name!r} "
                            "(extra_info.interaction_kwargs.name) is not on; agent.interactions is "
                            f"[{', '.join(sorted(available))}].",
                            "Add it to agent.interactions, or fix the data's interaction_kwargs.name.")
        kwargs.setdefault("ground_truth", self.row.get("ground_truth"))
        interaction = available[name]
        if callable(getattr(interaction, "for_episode", None)):
            interaction = interaction.for_episode(dict(kwargs))  # type: ignore[attr-defined]
        self._interaction = (str(name), interaction, kwargs)
        return self._interaction

    def append_messages(self, messages: Sequence[dict[str, Any]]) -> int:
        """Append turns that are not the model's (tool results: ``{"role": "tool", "name": ..., "content": ...}``;
        or a user turn) as the chat template renders them after the model's last turn, followed by the prompt of
        the model's next turn. Their tokens are read by the model and not trained (loss mask 0). Returns the
        tokens appended; what would pass the token budget is cut, and an episode whose budget they use up ends
        (``budget``)."""
        ids = self._runner.render_turns(messages)
        room = self.budget_left
        if len(ids) >= room:  # cut, or the budget's last tokens: the episode cannot go on, and says why
            ids = ids[:room]
            self.end = "budget"
        self.ids.extend(ids)
        self.trained.extend([0] * len(ids))
        self.log_probs.extend([0.0] * len(ids))
        self.messages.extend(dict(m) for m in messages)
        return len(ids)

    def append_tokens(self, ids: Sequence[int]) -> int:
        """Append tokens that are not the model's as they are (loss mask 0), within the token budget."""
        ids = list(ids)[: self.budget_left]
        self.ids.extend(ids)
        self.trained.extend([0] * len(ids))
        self.log_probs.extend([0.0] * len(ids))
        return len(ids)

    @property
    def done(self) -> bool:
        """Whether the episode cannot go on: its budget is spent or its last turn was cut by it."""
        return self.end == "budget" or self.budget_left <= 0


@dataclass
class _Request:
    episode: Episode
    future: asyncio.Future[tuple[list[int], list[float], bool]]


@dataclass
class _Scheduler:
    """Episode states on the event loop: an episode is running (its loop's code or its tools) or waiting for a turn;
    when none is running, the waiting ones' turns go to the engine as one call. Waiting for every episode's tools
    (each within its time limit) keeps the calls' composition, and so a seeded run's samples, independent of how
    fast the tools were."""

    running: int = 0
    waiting: list[_Request] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class EpisodeRunner:
    """Runs a batch of episodes with one agent loop (see the module docstring).

    ``generate(prompts, params)`` is the engine call (the rollout worker group's ``RolloutEngine.generate``);
    ``tools`` the built tools by name; ``max_tokens`` of the sampling parameters given to :meth:`run` is the
    episode's token budget (``data.max_response_length``), tool results included.
    """

    def __init__(self, loop: Any, tools: dict[str, Tool], tokenizer: Any, limits: AgentLimits,
                 generate: Callable[[Batch, SamplingParams], Batch], loop_name: str = "agent loop",
                 interactions: dict[str, Interaction] | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.loop, self.tools, self.tokenizer, self.limits = loop, tools, tokenizer, limits
        self.template_kwargs = dict(template_kwargs or {})  # data.apply_chat_template_kwargs
        self.interactions = dict(interactions or {})
        self._generate, self.loop_name = generate, loop_name
        self.max_tokens = 0
        self._params = SamplingParams()
        self._calls = 0
        self._sched = _Scheduler()
        self._tool_slots: asyncio.Semaphore | None = None
        self._stop_ids = set(_stop_ids(tokenizer))
        self._render_cache: dict[str, list[int]] = {}
        self._tool_schemas = [t.schema() for t in tools.values()] or None
        self._has_log_probs = True

    # -- the batch ------------------------------------------------------------------------------
    def run(self, prompts: Batch, params: SamplingParams) -> Batch:
        """``params.n`` episodes per prompt (each prompt's adjacent), as a rollout batch (the module docstring)."""
        rows = prompts.repeat_interleave(params.n)
        self.max_tokens, self._params, self._calls = params.max_tokens, params, 0
        ids, mask = rows["input_ids"], rows["attention_mask"]
        episodes = []
        for i in range(len(rows)):
            prompt = [int(t) for t, m in zip(ids[i].tolist(), mask[i].tolist()) if m]
            episodes.append(Episode(self, i, prompt, {k: v[i] for k, v in rows.non_tensors.items()}))
        _run_coroutine(self._run_all(episodes))
        return self._assemble(rows, episodes)

    async def _run_all(self, episodes: list[Episode]) -> None:
        self._sched = _Scheduler(running=len(episodes))
        self._tool_slots = asyncio.Semaphore(self.limits.max_concurrent_tools)
        tasks = [asyncio.ensure_future(self._episode(ep)) for ep in episodes]
        try:
            while not all(t.done() for t in tasks):
                s = self._sched
                if s.running == 0 and s.waiting:
                    batch, s.waiting = s.waiting, []
                    # On this thread, blocking the loop: nothing else could move (tool threads run on), and an
                    # engine on the caller's CUDA stream stays on it.
                    outputs = self._engine_call([r.episode for r in batch])
                    for r, out in zip(batch, outputs):
                        s.running += 1
                        r.future.set_result(out)
                    continue
                s.changed.clear()
                await s.changed.wait()
            for t in tasks:
                t.result()  # an agent loop's own error
        finally:
            for t in tasks:
                t.cancel()

    async def _episode(self, ep: Episode) -> None:
        try:
            await self.loop.run(ep)
        except (UserError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise RuntimeError(f"The {self.loop_name} failed in episode {ep.index} after {ep.turns} turn(s): "
                               f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._sched.running -= 1
            self._sched.changed.set()

    async def request_turn(self, ep: Episode) -> tuple[list[int], list[float], bool]:
        fut: asyncio.Future[tuple[list[int], list[float], bool]] = asyncio.get_running_loop().create_future()
        s = self._sched
        s.waiting.append(_Request(ep, fut))
        s.running -= 1
        s.changed.set()
        return await fut  # the scheduler counts the episode as running again when it sets the result

    def _engine_call(self, episodes: list[Episode]) -> list[tuple[list[int], list[float], bool]]:
        """One engine call for these episodes' next turns: each continues its prompt and tokens so far, for at most
        its budget left."""
        import torch

        from rlx.batch import Batch

        contexts = [ep.prompt_ids + ep.ids for ep in episodes]
        width = max(len(c) for c in contexts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(contexts), width), pad, dtype=torch.long)
        attention = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, c in enumerate(contexts):
            input_ids[i, width - len(c):] = torch.tensor(c, dtype=torch.long)
            attention[i, width - len(c):] = 1
        budgets = [ep.budget_left for ep in episodes]
        seed = None if self._params.seed is None else (self._params.seed + 7919 * self._calls) % 2**32
        self._calls += 1
        params = replace(self._params, n=1, max_tokens=max(budgets), seed=seed)
        out = self._generate(Batch({"input_ids": input_ids, "attention_mask": attention}), params)
        responses, rmask = out["responses"].tolist(), out["response_mask"].tolist()
        logp = out["rollout_log_probs"].tolist() if "rollout_log_probs" in out.tensors else None
        results = []
        for i, budget in enumerate(budgets):
            n = min(int(sum(rmask[i])), budget)
            ids = [int(t) for t in responses[i][:n]]
            stopped = bool(ids) and ids[-1] in self._stop_ids
            results.append((ids, [float(x) for x in logp[i][:n]] if logp is not None else [0.0] * n, stopped))
        self._has_log_probs = logp is not None
        return results

    # -- tools ----------------------------------------------------------------------------------
    async def run_tool(self, tool: Tool, call: ToolCall) -> tuple[str, str | None]:
        """(content, error kind or None) of one call, in a thread of its own, within ``tool_timeout_s``. A tool
        that ignores its time limit keeps its thread until it returns; the episode does not wait for it."""
        assert self._tool_slots is not None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[str, str | None]] = loop.create_future()
        timeout = self.limits.tool_timeout_s

        def work() -> None:
            try:
                value = tool(dict(call.arguments))
                out: tuple[str, str | None] = (_as_text(value), None)
            except ToolError as exc:
                text = str(exc)
                out = (text if text.startswith("Error") else f"Error: {text}", "error")
            except Exception as exc:  # a tool's bug is the model's tool turn, never the run's crash
                out = (f"Error: {type(exc).__name__}: {exc}", "error")
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(out))

        async with self._tool_slots:
            threading.Thread(target=work, name=f"rlx-tool-{call.name}", daemon=True).start()
            try:
                return await asyncio.wait_for(asyncio.shield(fut), timeout)
            except asyncio.TimeoutError:
                return f"Error: the tool {call.name!r} did not answer within {timeout:g} s.", "timeout"

    # -- the chat template ------------------------------------------------------------------------
    def render_turns(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The tokens of ``messages`` as the chat template writes them after an assistant turn that ended with its
        stop token, up to and including the prompt of the next assistant turn."""
        key = json.dumps(list(messages), sort_keys=True, default=str)
        cached = self._render_cache.get(key)
        if cached is None:
            cached = render_after_turn(self.tokenizer, list(messages), self._tool_schemas, self.template_kwargs)
            if len(self._render_cache) < 4096:
                self._render_cache[key] = cached
        return list(cached)

    # -- the rollout batch ------------------------------------------------------------------------
    def _assemble(self, rows: Batch, episodes: list[Episode]) -> Batch:
        import torch

        from rlx.batch import Batch

        width = max([len(ep.ids) for ep in episodes] + [1])
        b = len(episodes)
        pad = self.tokenizer.pad_token_id
        responses = torch.full((b, width), pad, dtype=torch.long)
        response_mask = torch.zeros((b, width), dtype=torch.long)
        loss_mask = torch.zeros((b, width), dtype=torch.long)
        log_probs = torch.zeros((b, width), dtype=torch.float32)
        for i, ep in enumerate(episodes):
            n = len(ep.ids)
            if n:
                responses[i, :n] = torch.tensor(ep.ids, dtype=torch.long)
                response_mask[i, :n] = 1
                loss_mask[i, :n] = torch.tensor(ep.trained, dtype=torch.long)
                log_probs[i, :n] = torch.tensor(ep.log_probs, dtype=torch.float32)
        tensors: dict[str, torch.Tensor] = {
            "prompts": rows["input_ids"], "prompt_mask": rows["attention_mask"], "responses": responses,
            "response_mask": response_mask, "loss_mask": loss_mask}
        if self._has_log_probs:
            tensors["rollout_log_probs"] = log_probs
        tensors["agent/turns"] = torch.tensor([float(ep.turns) for ep in episodes])
        for key in ("tool_calls", "tool_errors", "tool_timeouts", "malformed_calls"):
            tensors[f"agent/{key}"] = torch.tensor([float(ep.stats[key]) for ep in episodes])
        for reason in END_REASONS:
            tensors[f"agent/end/{reason}"] = torch.tensor([float(ep.end == reason) for ep in episodes])
        non = dict(rows.non_tensors)
        non["messages"] = [ep.messages for ep in episodes]
        if self.interactions:
            tensors["agent/interaction_turns"] = torch.tensor(
                [float(ep.stats.get("interaction_turns", 0)) for ep in episodes])
            tensors["agent/turn_score_sum"] = torch.tensor([float(sum(ep.turn_scores)) for ep in episodes])
            tensors["agent/turn_score_count"] = torch.tensor([float(len(ep.turn_scores)) for ep in episodes])
            # What a reward reads, as verl's reward managers give it: the scores in the row's extra_info.
            non["extra_info"] = [{**(e if isinstance(e, dict) else {}), "turn_scores": list(ep.turn_scores)}
                                 for e, ep in zip(non.get("extra_info", [{}] * len(episodes)), episodes)]
        return Batch(tensors, non)


def episode_metrics(batch: Batch) -> dict[str, float]:
    """The step's agent metrics from a batch of episodes (empty for single-turn rollouts): turns and tool calls per
    episode, tool errors, time-outs and malformed calls per episode, how episodes ended, their length and the
    share of their tokens that are tool output (not trained)."""
    if "loss_mask" not in batch.tensors:
        return {}
    out: dict[str, float] = {}
    turns = batch["agent/turns"]
    out["agent/turns/mean"], out["agent/turns/max"] = float(turns.mean()), float(turns.max())
    for key in ("tool_calls", "tool_errors", "tool_timeouts", "malformed_calls"):
        if f"agent/{key}" in batch.tensors:
            out[f"agent/{key}/mean"] = float(batch[f"agent/{key}"].mean())
    for reason in END_REASONS:
        if f"agent/end/{reason}" in batch.tensors:
            out[f"agent/end/{reason}"] = float(batch[f"agent/end/{reason}"].mean())
    if "agent/interaction_turns" in batch.tensors:
        out["agent/interaction_turns/mean"] = float(batch["agent/interaction_turns"].mean())
        count = float(batch["agent/turn_score_count"].sum())
        if count:
            out["agent/turn_score/mean"] = float(batch["agent/turn_score_sum"].sum()) / count
    length = batch["response_mask"].sum(-1).float()
    out["agent/episode_length/mean"], out["agent/episode_length/max"] = float(length.mean()), float(length.max())
    total = float(length.sum())
    trained = float((batch["response_mask"] * batch["loss_mask"]).sum())
    out["agent/masked_token_share"] = 1.0 - trained / total if total else 0.0
    return out


def render_after_turn(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """What the chat template appends after an assistant turn for ``messages``: the template is rendered for a
    short conversation with and without them; the difference, from just after the assistant's end-of-turn token,
    is tokenized. A template that writes the earlier turns differently once more follow cannot be continued this
    way: that is a :class:`UserError`. ``template_kwargs`` (``data.apply_chat_template_kwargs``) go to both
    renderings, as to the prompts'."""
    base = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    kwargs: dict[str, Any] = {**(template_kwargs or {}), "tokenize": False}
    if tools:
        kwargs["tools"] = tools
    try:
        before = tokenizer.apply_chat_template(base, **kwargs)
        after = tokenizer.apply_chat_template(base + messages, add_generation_prompt=True, **kwargs)
    except Exception as exc:
        raise UserError(f"The model's chat template cannot render a tool turn ({type(exc).__name__}: {exc}).",
                        "Multi-turn rollouts need a chat template that accepts messages of role 'tool' (Qwen2.5, "
                        "Qwen3, Llama 3.1 do): use such a model, or set its tokenizer's chat_template.") from None
    if not after.startswith(before):
        raise UserError("The model's chat template writes earlier turns differently once a tool turn follows, so "
                        "an episode's tokens cannot be continued turn by turn.",
                        "Use a chat template that only appends (Qwen2.5, Qwen3 and Llama 3.1's do).")
    eos = tokenizer.eos_token or ""
    cut = before.rfind(eos) if eos else -1
    tail = before[cut + len(eos):] if cut >= 0 else ""
    return list(tokenizer(tail + after[len(before):], add_special_tokens=False)["input_ids"])


def _checked_reply(reply: Any, name: str) -> InteractionReply:
    """An interaction's reply, checked: a content string, a finite score or None, a done flag."""
    import math

    if not isinstance(reply, InteractionReply):
        raise TypeError(f"interaction {name!r} returned {type(reply).__name__}, not an rlx.protocols.InteractionReply")
    if not isinstance(reply.content, str):
        raise TypeError(f"interaction {name!r} replied with content of type {type(reply.content).__name__}, not str")
    score = reply.score
    if score is not None and (isinstance(score, bool) or not isinstance(score, int | float)
                              or not math.isfinite(score)):
        raise TypeError(f"interaction {name!r} gave the score {score!r}; a finite number or None is expected")
    return replace(reply, score=None if score is None else float(score), done=bool(reply.done))


def _stop_ids(tokenizer: Any) -> list[int]:
    eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def _run_coroutine(coro: Any) -> None:
    """Run ``coro`` to the end on a fresh event loop; in a thread of its own where this thread already runs one
    (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    error: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(coro)
        except BaseException as exc:
            error.append(exc)

    t = threading.Thread(target=target, name="rlx-episodes")
    t.start()
    t.join()
    if error:
        raise error[0]
