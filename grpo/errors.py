"""The one exception type that ``python -m grpo.train`` turns into a one-line error message and exit status 2."""


class UsageError(Exception):
    """A bad argument or input file: reported as ``grpo.train: error: <message>`` without a traceback."""
