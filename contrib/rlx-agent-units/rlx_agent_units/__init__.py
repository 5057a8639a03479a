"""rlx-agent-units: an example third-party agent plugin for rlx.

Two components, registered through the one ``rlx`` entry point of this distribution:

- ``units`` (kind ``tool``, :mod:`rlx_agent_units.units`): converts a value between units of length, mass,
  temperature and time (``agent.tools=[units]``, options ``tools.units.precision``, ``tools.units.max_magnitude``);
- ``check_once`` (kind ``agent_loop``, :mod:`rlx_agent_units.loop`): multi-turn tool calls, and after the first
  answer one user turn asking the model to check it (``agent.name=check_once``, options ``agent.check_prompt``,
  ``agent.format``).

The factories and option models are named as ``module:attribute`` references, so listing plugins imports
nothing but this module.
"""

from __future__ import annotations

from rlx import Component, hookimpl

__version__ = "0.1.0"


@hookimpl
def rlx_tools() -> list[Component]:
    return [Component(kind="tool", name="units", factory="rlx_agent_units.units:build_units",
                      config_model="rlx_agent_units.units:UnitsOptions",
                      summary="Converts a value between units of length, mass, temperature and time.")]


@hookimpl
def rlx_agent_loops() -> list[Component]:
    return [Component(kind="agent_loop", name="check_once", factory="rlx_agent_units.loop:build_check_once",
                      config_model="rlx_agent_units.loop:CheckOnceOptions",
                      summary="Tool calls (hermes/llama3), then one user turn asking the model to check its "
                              "first answer; the second answer ends the episode.")]
