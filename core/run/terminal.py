"""The terminal of a command: what libraries print."""

from __future__ import annotations

import os
import sys
from typing import Any


def quiet_libraries() -> None:
    """For a command: tokenizers not forking threads, rlx's warnings on one line each, transformers' logging
    and progress bars off."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    import rlx

    # rlx's own warnings as one line each ("Warning: ..."), not Python's file:line and source-line pair;
    # a library's warnings keep Python's format.
    own = os.path.dirname(os.path.abspath(rlx.__file__)) + os.sep
    show = warnings.showwarning

    def one_line(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if not os.path.abspath(filename).startswith(own):
            return show(message, category, filename, lineno, file, line)
        print(f"Warning: {message}", file=file or sys.stderr)

    warnings.showwarning = one_line
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
