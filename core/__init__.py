"""rlx: plugin-based reinforcement-learning post-training for Hugging Face language models.

The package is kept light at import time: nothing here imports torch. Plugins register
components through the ``rlx`` entry-point group, using :data:`hookimpl` and :class:`Component`.
"""

from importlib.metadata import PackageNotFoundError, version

from rlx import _compat
from rlx.components import Component, ComponentKind
from rlx.errors import UserError
from rlx.hookspecs import hookimpl

try:
    __version__ = version("rlx")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

_compat.install()  # the deprecated paths of moved modules (rlx.run.checkpoint -> rlx.run.checkpoint, ...)

__all__ = ["Component", "ComponentKind", "UserError", "__version__", "hookimpl"]
