"""What a component factory receives besides its own options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlx.config import RLXConfig
    from rlx.protocols import RunInfo
    from rlx.registry import PluginManager


@dataclass
class BuildContext:
    """Shared facts for building components: the whole resolved config, the run, the plugins.

    Factories are called as ``factory(options, ctx)``; ``options`` is the component's own validated
    config model instance (or ``None`` if it declares none). ``rank`` and ``world_size``: where a worker
    group builds the component, its rank within its pool and the pool's size (what the launcher passes to
    ``build(rank, world_size)``), so that, e.g., each rollout engine of a pool samples with its own seed;
    0 and 1 for what the driver builds.
    """

    config: RLXConfig | None
    run: RunInfo
    plugins: PluginManager | None = None
    tokenizer: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
