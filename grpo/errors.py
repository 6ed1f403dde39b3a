"""The one exception type that ``python -m grpo.train`` turns into a one-line error message and exit status 2."""


class UsageError(Exception):
    """A bad argument or input file: reported as ``grpo.train: error: <message>`` without a traceback."""


class OutputError(Exception):
    """A file of the run could not be written (disk full, read-only folder, no permission): reported as
    ``grpo.train: error: cannot write <file>: <cause>`` without a traceback, exit status 1."""
