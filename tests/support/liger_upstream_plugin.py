"""pytest plugin (``-p tests.support.liger_upstream_plugin``) that runs Liger-Kernel 0.8.5's own JSD tests (fetched
unmodified into .liger-upstream/0.8.5 by scripts/setup_liger_tests.sh) with Liger's JSD names bound to
grpo_kernels.liger's. Not a test module: tests/hf/test_liger_jsd.py runs Liger's tests in a subprocess from that folder
with this plugin (tests/support/liger_upstream.py).

Bound before Liger's test modules import them (they bind the names at import), every place a test or Liger's own
package reaches them:
- ``liger_kernel.transformers.LigerFusedLinearJSD`` (and ``.fused_linear_jsd.LigerFusedLinearJSD``);
- ``liger_kernel.transformers.functional.liger_fused_linear_jsd``;
- ``liger_kernel.chunked_loss.LigerFusedLinearJSDLoss`` (and ``.jsd_loss.LigerFusedLinearJSDLoss``);
- ``liger_kernel.chunked_loss.functional.liger_fused_linear_jsd`` (ours: ``chunked_liger_fused_linear_jsd``).
Liger's two autograd Functions named ``LigerFusedLinearJSDFunction`` (``liger_kernel.ops`` and
``liger_kernel.chunked_loss.jsd_loss``) stay Liger's: the tests' "functional" cases compare our function with them,
so there the peer is Liger itself.

The one adaptation of the device: none is needed. Liger's tests run on ``infer_device()``, which is "cpu" on a
machine without CUDA; Triton's interpreter (``TRITON_INTERPRET=1``, set here before Liger's kernels exist, as
tests/conftest.py does) runs the Triton kernel of Liger's own ``LigerFusedLinearJSDFunction`` on CPU tensors.
The summary line at the end counts the calls that reached grpo_kernels, so that a run cannot pass on Liger's code.

``GRPO_LIGER_UPSTREAM_FLIP_BETA=1`` (the check that Liger's tests can fail on ours, tests/hf/test_liger_jsd.py) makes
ours use ``1 - beta``: the other side of the generalized JSD, TRL's convention read backwards.
"""
from __future__ import annotations

import collections
import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

import liger_kernel.chunked_loss  # noqa: E402
import liger_kernel.chunked_loss.functional  # noqa: E402
import liger_kernel.chunked_loss.jsd_loss  # noqa: E402
import liger_kernel.transformers  # noqa: E402
import liger_kernel.transformers.functional  # noqa: E402
import liger_kernel.transformers.fused_linear_jsd  # noqa: E402

from grpo_kernels import liger as ours  # noqa: E402
from grpo_kernels import liger_jsd  # noqa: E402
from tests.support.liger_upstream import FLIP_ENV  # noqa: E402

FLIP_BETA = os.environ.get(FLIP_ENV) == "1"
if FLIP_BETA:
    _beta = liger_jsd._beta
    liger_jsd._beta = lambda name, value: 1.0 - _beta(name, value)

CALLS: collections.Counter = collections.Counter()


def _counted(fn, name: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        CALLS[name] += 1
        return fn(*args, **kwargs)
    return wrapper


class _FusedJSD(ours.LigerFusedLinearJSD):
    forward = _counted(ours.LigerFusedLinearJSD.forward, "LigerFusedLinearJSD")


class _ChunkedJSDLoss(ours.LigerFusedLinearJSDLoss):
    forward = _counted(ours.LigerFusedLinearJSDLoss.forward, "LigerFusedLinearJSDLoss")


_FusedJSD.__name__, _ChunkedJSDLoss.__name__ = "LigerFusedLinearJSD", "LigerFusedLinearJSDLoss"

BINDINGS = {
    (liger_kernel.transformers, "LigerFusedLinearJSD"): _FusedJSD,
    (liger_kernel.transformers.fused_linear_jsd, "LigerFusedLinearJSD"): _FusedJSD,
    (liger_kernel.transformers.functional, "liger_fused_linear_jsd"):
        _counted(ours.liger_fused_linear_jsd, "liger_fused_linear_jsd"),
    (liger_kernel.chunked_loss, "LigerFusedLinearJSDLoss"): _ChunkedJSDLoss,
    (liger_kernel.chunked_loss.jsd_loss, "LigerFusedLinearJSDLoss"): _ChunkedJSDLoss,
    (liger_kernel.chunked_loss.functional, "liger_fused_linear_jsd"):
        _counted(ours.chunked_liger_fused_linear_jsd, "chunked_liger_fused_linear_jsd"),
}
for (module, name), value in BINDINGS.items():
    setattr(module, name, value)


def pytest_terminal_summary(terminalreporter):
    bound = ", ".join(f"{m.__name__}.{n}" for m, n in BINDINGS)
    calls = ", ".join(f"{name} {CALLS[name]}" for name in sorted(CALLS)) or "none"
    flipped = " (beta flipped)" if FLIP_BETA else ""
    terminalreporter.write_line(f"grpo_kernels.liger: bound {bound}; calls: {calls}{flipped}")
