"""Task code: the data recipes of ``rlx data prepare`` (gsm8k, MATH, preference pairs) and the built-in
model and data (``builtin:tiny-qwen2``, ``builtin:arith-*``), which this plugin registers as the resource
scheme ``builtin`` (core resolves a ``scheme:name`` reference through whichever plugin registered the scheme)."""

from __future__ import annotations

from collections.abc import Iterable

from rlx import Component, hookimpl


@hookimpl
def rlx_resources() -> Iterable[Component]:
    return [Component(kind="resource", name="builtin", factory="rlx.plugins.tasks.builtin:resolve",
                      summary="builtin:NAME: the tiny model and arithmetic data, written on first use")]
