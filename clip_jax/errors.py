"""The errors a user can fix: a bad setting, a missing file, a run that cannot go on.

Every command-line entry point catches `UserError` and prints its message as one line with exit status 2 (the
data tools keep their status 1); any other exception is a bug in clip_jax and keeps its traceback. The subclasses
also derive from the built-in kind that describes them (`ValueError`, `FileNotFoundError`, `RuntimeError`), so
callers that catch those keep working.
"""


class UserError(Exception):
    """A problem in what the user gave or in the run's surroundings, told in one line."""


class InvalidInput(UserError, ValueError):
    """A setting, argument or input file whose value clip_jax cannot use."""


class MissingInput(UserError, FileNotFoundError):
    """A file or folder the user named that is not there."""


class RunFailed(UserError, RuntimeError):
    """The environment or the run itself stops it: a cluster that does not start, a loss that keeps diverging."""
