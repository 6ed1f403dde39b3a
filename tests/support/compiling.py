"""The torch.compile tests' backend (tests/api/test_compile.py, test_compile_dynamic.py); their fixture resetting
Dynamo around each test is ``fresh_dynamo`` in tests/conftest.py."""
import torch


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given (one per compile / recompile) and hands them to
    ``inner`` (aot_eager: AOTAutograd with the ops' fake kernels and autograd registrations, no code generation)."""

    def __init__(self, inner="aot_eager"):
        self.inner = torch._dynamo.lookup_backend(inner)
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)
