"""The ``kernel_overrides`` fixture: ``kernel_overrides(max_block_v=128)`` enters
``grpo_kernels.kernels.common.testing(...)`` for the rest of the test (import the fixture into a test module)."""
import contextlib

import pytest


@pytest.fixture
def kernel_overrides():
    from grpo_kernels.kernels.common import testing

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(testing(**changes))
