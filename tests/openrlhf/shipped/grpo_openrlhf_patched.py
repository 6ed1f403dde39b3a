"""A pytest plugin (``-p grpo_openrlhf_patched``) that runs OpenRLHF's own shipped tests with grpo_kernels.openrlhf
in effect: tests/openrlhf/test_openrlhf_shipped.py starts ``python -m pytest`` in .venv-openrlhf/openrlhf-tests (where
scripts/setup_openrlhf.sh moved OpenRLHF's ``tests`` package) with this folder on PYTHONPATH.

- at configure time it imports ``grpo_kernels.openrlhf`` (``openrlhf.models.actor.Actor`` patched);
- after collection it also patches every other copy of OpenRLHF's Actor class that a test module loaded from
  ``openrlhf/models/actor.py`` under another module name (OpenRLHF's ``test_actor_entropy_temperature.py`` does so, to
  import it without DeepSpeed): ``patch(actor_class=...)``;
- it counts the Actor.forward calls that ran on grpo_kernels' head and those handed to OpenRLHF's own forward (with
  the reason), and prints them at the end: ``grpo_kernels.openrlhf: patched ...; calls: N on grpo_kernels, M on
  OpenRLHF's forward (reasons)``.
"""
import collections
import os
import sys

_COUNTS = collections.Counter()


def pytest_configure(config):
    import grpo_kernels.openrlhf  # noqa: F401  (patches OpenRLHF's Actor)
    from grpo_kernels.integrations import openrlhf as integration

    decide = integration._call_blocker

    def counted(*args, **kwargs):
        reason = decide(*args, **kwargs)
        _COUNTS["grpo_kernels" if reason is None else f"OpenRLHF ({reason})"] += 1
        return reason

    integration._call_blocker = counted


def pytest_collection_finish(session):
    from grpo_kernels.integrations.openrlhf import patch_openrlhf

    suffix = os.path.join("openrlhf", "models", "actor.py")
    for name, module in list(sys.modules.items()):
        if name == "openrlhf.models.actor" or not str(getattr(module, "__file__", None) or "").endswith(suffix):
            continue
        cls = vars(module).get("Actor")  # vars: a lazy module's getattr would import things
        if isinstance(cls, type) and cls.__module__ == name:
            patch_openrlhf(actor_class=cls)


def pytest_terminal_summary(terminalreporter):
    from grpo_kernels.integrations.openrlhf import _STATE

    patched = ", ".join(f"{c.__module__}.{c.__qualname__}.forward" for c in _STATE["originals"])
    calls = ", ".join(f"{n} on {where}" for where, n in sorted(_COUNTS.items())) or "none"
    terminalreporter.write_line(f"grpo_kernels.openrlhf: patched {patched}; Actor.forward calls: {calls}")
