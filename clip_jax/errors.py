"""The errors a user can fix: a bad setting, a missing file, a run that cannot go on.

Every command's entry (`clip_jax.runtime.entry`) catches `UserError` and prints its message as one line with exit status 2
(the data tools keep their status 1), or 1 when the run itself failed (`RunFailed`: a full disk, a cluster that
does not start, a loss that keeps diverging; `exit_status`). Any other exception is a bug in clip_jax and keeps its
traceback. The subclasses
also derive from the built-in kind that describes them (`ValueError`, `FileNotFoundError`, `RuntimeError`,
`ModuleNotFoundError`), so callers that catch those keep working.
"""

import importlib.util

DISTRIBUTION = "clipjax-train"  # the name pip installs clip_jax and its extras under (setup.py)


class UserError(Exception):
    """A problem in what the user gave or in the run's surroundings, told in one line."""


class InvalidInput(UserError, ValueError):
    """A setting, argument or input file whose value clip_jax cannot use."""


class MissingInput(UserError, FileNotFoundError):
    """A file or folder the user named that is not there."""


class RunFailed(UserError, RuntimeError):
    """The environment or the run itself stops it: a cluster that does not start, a loss that keeps diverging."""


class MissingExtra(UserError, ModuleNotFoundError):
    """An optional package a feature needs is not installed; the message names the pip extra that brings it."""


def exit_status(error: UserError) -> int:
    """The trainer's exit status for `error`: 1 for a run that failed (`RunFailed`), 2 for bad input or config."""
    return 1 if isinstance(error, RunFailed) else 2


def require_extra(package: str, extra: str | None, needed_by: str, *, alternative: str = "") -> None:
    """Raises `MissingExtra` ("NEEDED_BY needs the PACKAGE package, which is not installed: pip install
    'clipjax-train[EXTRA]'", or `pip install PACKAGE` when no extra brings it; then "; or ALTERNATIVE") when
    `package` cannot be found. Looks it up without importing it, so that a command checks what it will need before
    it does the work."""
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package that is missing; a module loaded without a spec
        found = False
    if not found:
        install = f"pip install '{DISTRIBUTION}[{extra}]'" if extra else f"pip install {package}"
        raise MissingExtra(f"{needed_by} needs the {package} package, which is not installed: {install}"
                           + (f"; or {alternative}" if alternative else ""))
