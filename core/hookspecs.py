"""The contract between rlx and its plugins: every hook a plugin may implement.

Registration hooks (``rlx_*s``) are collecting hooks: every plugin may answer, and each answer is
an iterable of :class:`rlx.Component` records. Lifecycle hooks (``rlx_on_*``) are notifications:
their return values are ignored, they observe the run and never steer it. An exception raised by a
lifecycle hook stops the run with a message naming the plugin, the hook and the step.

A plugin is a module (or object) with functions decorated by :data:`hookimpl`, registered through
the ``rlx`` entry-point group::

    [project.entry-points.rlx]
    my_reward = "my_package.plugin"
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import typer

    from rlx.components import Component

PROJECT = "rlx"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def rlx_train_backends() -> Iterable[Component]:
    """Return the training backends this plugin provides (``kind="backend"``).

    Called once when the plugin manager is built. A backend's factory returns an object satisfying
    :class:`rlx.protocols.TrainBackend`.

    Example::

        @hookimpl
        def rlx_train_backends():
            return [Component(kind="backend", name="fsdp2", factory="pkg.fsdp2:build")]
    """


@hookspec
def rlx_rollout_engines() -> Iterable[Component]:
    """Return the rollout (generation) engines this plugin provides (``kind="rollout"``).

    A rollout factory returns an object satisfying :class:`rlx.protocols.RolloutEngine`.
    """


@hookspec
def rlx_algorithms() -> Iterable[Component]:
    """Return the RL algorithms this plugin provides (``kind="algorithm"``).

    An algorithm factory returns an object satisfying :class:`rlx.protocols.Algorithm`.
    """


@hookspec
def rlx_advantage_estimators() -> Iterable[Component]:
    """Return advantage estimators (``kind="advantage"``) that algorithms can select by name.

    The factory is the estimator itself (not a builder): ``fn(inputs: EstimatorInputs) ->
    (advantages, returns)``, both (B, R); see :class:`rlx.protocols.EstimatorInputs` and
    :func:`rlx.protocols.advantage_estimator`. Users pick it with ``algorithm.adv_estimator=NAME``.
    """


@hookspec
def rlx_rewards() -> Iterable[Component]:
    """Return the rewards this plugin provides (``kind="reward"``).

    A reward factory returns a callable ``fn(batch: RewardBatch) -> list[float] | RewardOutput``.
    """


@hookspec
def rlx_loggers() -> Iterable[Component]:
    """Return the metric loggers this plugin provides (``kind="logger"``).

    A logger factory returns an object satisfying :class:`rlx.protocols.Logger`.
    """


@hookspec
def rlx_launchers() -> Iterable[Component]:
    """Return the launchers this plugin provides (``kind="launcher"``).

    A launcher places workers (in-process, one process per device, or on a Ray cluster) and
    returns worker groups; see :class:`rlx.protocols.Launcher`.
    """


@hookspec
def rlx_resources() -> Iterable[Component]:
    """Return the resource schemes this plugin provides (``kind="resource"``).

    A resource is a reference such as ``builtin:arith-train`` that a config may give wherever it names a file
    or a model folder. The component's ``name`` is the scheme (the part before ``:``) and its ``factory`` is
    ``resolve(ref) -> str``: the local path the reference stands for, written first if needed. It is how the
    tasks plugin provides the tiny built-in model and data without core knowing about them.
    """


@hookspec
def rlx_agent_loops() -> Iterable[Component]:
    """Return agent loops (``kind="agent_loop"``): what drives one episode of a multi-turn rollout (ask the
    engine for a turn, run the tools it calls, append their output, until an answer or a limit). The factory
    returns an :class:`rlx.protocols.AgentLoop`; ``agent.name`` picks one (``single_turn``, ``tool_call``)."""


@hookspec
def rlx_tools() -> Iterable[Component]:
    """Return tools (``kind="tool"``) that an agent's model may call. The factory returns an
    :class:`rlx.protocols.Tool`; ``agent.tools=[NAME, ...]`` picks them, ``tools.NAME.*`` are their options."""


@hookspec
def rlx_interactions() -> Iterable[Component]:
    """Return interactions (``kind="interaction"``): a simulated user that reads each answer of an episode's model
    and replies with a user turn, a turn score, or the end of the episode (verl's interactions). The factory
    returns an :class:`rlx.protocols.Interaction`; ``agent.interactions=[NAME, ...]`` turns them on, a data row's
    ``extra_info.interaction_kwargs.name`` picks one, ``interactions.NAME.*`` are their options."""


@hookspec
def rlx_cli_commands(app: typer.Typer) -> None:
    """Add commands to the ``rlx`` command-line app.

    Called once when the CLI starts, with the root :class:`typer.Typer` app. Keep the command
    modules light: import heavy libraries inside the command functions.
    """


@hookspec
def rlx_on_train_start(config: Mapping[str, Any], output_dir: str, plugins: Any, resumed: bool) -> None:
    """Called once before the first training step, with the resolved config as a plain dict, the run's
    :class:`rlx.registry.PluginManager` (``plugins``) and whether the run resumes from a checkpoint.
    An implementation may take any subset of these arguments (pluggy passes the ones it names)."""


@hookspec
def rlx_on_step_end(step: int, metrics: Mapping[str, float]) -> None:
    """Called after every training step with that step's metrics (the same ones the loggers get)."""


@hookspec
def rlx_on_checkpoint(step: int, path: str) -> None:
    """Called after a checkpoint has been completely and atomically written to ``path``."""


@hookspec
def rlx_on_train_end(step: int, metrics: Mapping[str, float]) -> None:
    """Called once when training finishes normally, with the last step's metrics."""


# Notification hooks the trainer calls through PluginManager.call_lifecycle.
LIFECYCLE_HOOKS: tuple[str, ...] = ("rlx_on_train_start", "rlx_on_step_end", "rlx_on_checkpoint", "rlx_on_train_end")

# Registration hook name -> the component kind its records must have.
REGISTRATION_HOOKS: dict[str, str] = {
    "rlx_train_backends": "backend",
    "rlx_rollout_engines": "rollout",
    "rlx_algorithms": "algorithm",
    "rlx_advantage_estimators": "advantage",
    "rlx_rewards": "reward",
    "rlx_loggers": "logger",
    "rlx_launchers": "launcher",
    "rlx_resources": "resource",
    "rlx_agent_loops": "agent_loop",
    "rlx_tools": "tool",
    "rlx_interactions": "interaction",
}
