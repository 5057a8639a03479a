"""Errors a user can cause. The CLI prints them as one readable paragraph and exits with status 2."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix: bad config, bad data, missing plugin or optional dependency.

    ``message`` says what is wrong; ``hint`` says how to fix it.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n{self.hint}"


class ConfigError(UserError):
    """One or more config problems, each with its dotted path. All are reported at once."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        n = len(problems)
        header = f"Invalid configuration ({n} problem{'s' if n != 1 else ''}):"
        super().__init__(header + "\n" + "\n".join(f"  - {p}" for p in problems),
                         "Run `rlx config show` to see the resolved config, "
                         "or `rlx plugins show NAME` for a component's options.")


class MissingDependencyError(UserError):
    """An optional dependency is not installed."""

    def __init__(self, package: str, extra: str, needed_for: str) -> None:
        super().__init__(
            f"{needed_for} needs the Python package `{package}`, which is not installed.",
            f"Install it with: pip install 'rlx[{extra}]'",
        )


def require(module: str, extra: str, needed_for: str):
    """Import an optional module or raise :class:`MissingDependencyError`."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(module.split(".")[0], extra, needed_for) from exc


def describe_exception(exc: BaseException) -> str:
    """``Type: message (file:line)`` of an exception, where it was raised; one line for a report."""
    import traceback

    tb = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" ({tb[0].filename}:{tb[0].lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """A ' Did you mean X?' suffix, or '' when nothing is close."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""
