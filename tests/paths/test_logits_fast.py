"""grpo_loss on the Triton path in both modes: the gradient written by the forward kernel (``grad_in_forward``, the
default where ``per_token_gradient_known``) and the separate forward / backward sweeps, against TRL's own
``_compute_loss``, the float64 reference, and each other; NaN propagation, awkward shapes, in place, memory."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

import grpo_kernels as gk
import grpo_kernels.loss as loss_module
from grpo_kernels import GRPOLossConfig
from grpo_kernels.kernels.logits_loss_kernels import N_TERMS
from grpo_kernels.loss_types import LOSS_TYPES, per_token_gradient_known

from ..support.cases import CASES, make_inputs, optional_inputs
from ..support.oracles import trl_loss_grad_metrics
from ..support.tolerances import assert_three_way, grad_scale, loss_truth_and_same_dtype

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_outputs")]
MODES = ("grad_in_forward", "separate")
TOKEN_CASES = [c for c in CASES if per_token_gradient_known(c.config)]


def _force(mode, monkeypatch):
    """Run ``mode`` and prove it ran: the other path raises."""
    def fail(*args, **kwargs):
        raise AssertionError(f"mode {mode}: the other path ran")
    if mode == "grad_in_forward":
        monkeypatch.setattr(loss_module, "logits_token_logprobs", fail)
    else:
        monkeypatch.setattr(loss_module, "logits_loss_in_forward", fail)
    return mode == "grad_in_forward"


def _ours(inputs, config, mode, monkeypatch, inplace=False, scale=1.0):
    with monkeypatch.context() as patch:
        gif = _force(mode, patch)
        x = inputs["logits"].clone().requires_grad_(True)
        loss, metrics = gk.grpo_loss(x, inputs["ids"], inputs["advantages"], inputs["mask"],
                                     config=config.replace(grad_in_forward=gif), impl="triton",
                                     inplace_backward=inplace, **optional_inputs(inputs))
        (grad,) = torch.autograd.grad(loss * scale, x)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", TOKEN_CASES, ids=lambda c: c.id)
def test_both_modes_match_trl(case, mode, monkeypatch):
    """fp32: loss, d logits and metrics against TRL 1.16's GRPOTrainer._compute_loss by the three-way rule (TRL in
    float64 the truth, TRL in fp32 the middle term)."""
    inputs = make_inputs(case)
    trl64, trl32 = (trl_loss_grad_metrics(inputs["logits"], inputs, case.config, dtype=d)
                    for d in (torch.float64, torch.float32))
    loss, grad, metrics = _ours(inputs, case.config, mode, monkeypatch)
    assert_three_way(loss, trl32[0], trl64[0], torch.float32, "loss")
    assert_three_way(grad, trl32[1], trl64[1], torch.float32, "d logits", scale=grad_scale(trl64[1]))
    for name in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "cispo_clip_ratio"):
        if name in trl64[2]:
            assert_three_way(metrics[name], trl32[2][name], trl64[2][name], torch.float32, name)


BF16_CASES = [c for c in TOKEN_CASES if c.id.endswith("-token") or c.id in ("entropy-bonus", "is-ratio-token",
                                                                           "delta", "temperature", "grpo-beta-kl")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.id)
def test_both_modes_three_way_bf16(case, mode, monkeypatch, knobs):
    """bf16 logits, V = 300 swept in blocks of 128 (two full blocks and a tail): loss and d logits against float64,
    no worse than plain PyTorch in bf16 (DESIGN.md's three-way rule)."""
    knobs(max_block_v=128)
    inputs = make_inputs(case, B=3, T=4, V=300, dtype=torch.bfloat16, seed=7)
    loss64, grad64, loss_d, grad_d = loss_truth_and_same_dtype(inputs, case.config)
    loss, grad, _ = _ours(inputs, case.config, mode, monkeypatch)
    assert grad.dtype == torch.bfloat16
    assert_three_way(loss, loss_d, loss64, torch.bfloat16, "loss")
    assert_three_way(grad, grad_d, grad64, torch.bfloat16, "d logits", scale=grad_scale(grad64))


# vespo's gradient needs its row's ratio sum: it has no grad-in-forward mode.
NAN_PARAMS = [(lt, mode) for lt in LOSS_TYPES for mode in MODES
              if mode == "separate" or per_token_gradient_known(GRPOLossConfig(loss_type=lt))]


@pytest.mark.parametrize("loss_type,mode", NAN_PARAMS)
def test_nan_logit_at_a_valid_token_propagates(loss_type, mode, monkeypatch):
    """On-policy (no old log-probs), a NaN logit at a valid token makes the loss NaN, as in PyTorch; before
    token_terms propagated NaN through min / max, the clipped loss types returned a finite loss here."""
    case = next(c for c in CASES if c.id == f"{loss_type}-token")
    inputs = make_inputs(case, B=2, T=3, V=40, seed=3)
    inputs.pop("old_logps", None)
    inputs["mask"] = torch.ones(2, 3, dtype=torch.bool)
    inputs["advantages"] = torch.tensor([1.0, -1.0])
    inputs["logits"][1, 2, 5] = float("nan")
    x = inputs["logits"].clone().requires_grad_(True)
    expected, _ = gk.grpo_loss(x, inputs["ids"], inputs["advantages"], inputs["mask"], config=case.config,
                               impl="torch")
    assert math.isnan(expected.item())
    loss, grad, _ = _ours(inputs, case.config, mode, monkeypatch)
    assert math.isnan(loss.item()), f"{loss_type} {mode}: NaN logit gave a finite loss {loss.item()}"
    if loss_type != "vespo":  # vespo's gradient runs through its row's ratio sum: NaN across the row
        assert torch.isnan(grad[1, 2]).all() and torch.isfinite(grad[0]).all()


SHAPES = {"T1-V37": (3, 1, 37, None), "V1000-blocks256": (2, 5, 1000, 256), "V256-blocks64-no-tail": (2, 3, 256, 64),
          "V37": (4, 7, 37, None)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_awkward_shapes_and_fully_masked_rows(shape, mode, monkeypatch, knobs):
    """T = 1, V not a multiple of 16, multi-block rows with and without a tail, a fully masked sequence
    (make_inputs masks row 1): equal to the torch path, padded tokens get an exactly zero gradient, NaN logits there
    change nothing."""
    B, T, V, block = shape
    if block:
        knobs(max_block_v=block)
    case = next(c for c in CASES if c.id == "everything")
    config = case.config.replace(top_entropy_quantile=1.0, off_policy_mask_threshold=None)  # token-local
    inputs = make_inputs(case, B=B, T=T, V=V, seed=B * T + V)
    inputs.pop("sampling_logps")
    clean = inputs["logits"].clone()
    inputs["logits"][~inputs["mask"]] = float("nan")
    loss, grad, metrics = _ours(inputs, config, mode, monkeypatch)
    y = clean.requires_grad_(True)
    expected, expected_metrics = gk.grpo_loss(y, inputs["ids"], inputs["advantages"], inputs["mask"],
                                              config=config, impl="torch", **optional_inputs(inputs))
    (expected_grad,) = torch.autograd.grad(expected, y)
    assert (grad[~inputs["mask"]] == 0).all()
    # both paths against float64 on the clean logits by the three-way rule (each within it: within twice of each other)
    loss64, grad64, metrics64, loss_d, grad_d, metrics_d = loss_truth_and_same_dtype(
        dict(inputs, logits=clean.detach()), config, with_metrics=True)
    results = {"triton": (loss, grad, metrics), "torch": (expected, expected_grad, expected_metrics)}
    for path, (l, g, m) in results.items():
        assert_three_way(l.detach(), loss_d, loss64, torch.float32, f"{path} loss")
        assert_three_way(g, grad_d, grad64, torch.float32, f"{path} d logits", scale=grad_scale(grad64))
        for k in m:
            assert_three_way(m[k], metrics_d[k], metrics64[k], torch.float32, f"{path} metric {k}")


def test_in_place_writes_d_logits_in_the_forward(monkeypatch, knobs):
    """inplace_backward with grad_in_forward: the logits buffer holds d logits when grpo_loss returns, the
    gradient is that buffer (same storage), scaled by grad_output, and equal to the new-buffer mode's."""
    knobs(max_block_v=64)
    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    inputs = make_inputs(case, B=3, T=4, V=150, dtype=torch.bfloat16, seed=5)
    expected = _ours(inputs, case.config, "grad_in_forward", monkeypatch, scale=2.0)[1]
    x = inputs["logits"].clone().requires_grad_(True)
    loss, _ = gk.grpo_loss(x, inputs["ids"], inputs["advantages"], inputs["mask"], config=case.config,
                           impl="triton", inplace_backward=True, **optional_inputs(inputs))
    assert torch.equal(x.detach() * 2, expected), "the buffer must hold d logits (for a loss scaled by 1)"
    (loss * 2.0).backward()
    assert x.grad.data_ptr() == x.data_ptr()
    assert torch.equal(x.grad, expected)
    with pytest.raises(RuntimeError, match="retain_graph"):
        x2 = inputs["logits"].clone().requires_grad_(True)
        loss2, _ = gk.grpo_loss(x2, inputs["ids"], inputs["advantages"], inputs["mask"], config=case.config,
                                impl="triton", **optional_inputs(inputs))
        loss2.backward(retain_graph=True)
        loss2.backward()


def test_no_grad_forward_leaves_the_logits_alone():
    """Without a gradient to compute (no_grad), the forward-only sweep runs and in-place mode modifies nothing."""
    case = next(c for c in CASES if c.id == "dapo-token")
    inputs = make_inputs(case, B=2, T=3, V=50)
    x = inputs["logits"].clone().requires_grad_(True)
    with torch.no_grad():
        loss, _ = gk.grpo_loss(x, inputs["ids"], inputs["advantages"], inputs["mask"], config=case.config,
                               impl="triton", inplace_backward=True, **optional_inputs(inputs))
    assert torch.equal(x.detach(), inputs["logits"])
    loss64, _, loss_d, _ = loss_truth_and_same_dtype(inputs, case.config)
    assert_three_way(loss, loss_d, loss64, torch.float32, "loss")


class _Allocations(TorchDispatchMode):
    """Largest tensor created by any out-of-place torch op (kernel launches excluded: the interpreter copies)."""

    def __init__(self):
        super().__init__()
        self.largest = (0, None)
        self.total_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            # views and in-place results share an input's storage: not an allocation
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.total_bytes += t.numel() * t.element_size()
                if t.numel() > self.largest[0]:
                    self.largest = (t.numel(), str(func))
        return out


def test_in_place_path_allocates_nothing_of_the_logits_size(monkeypatch):
    """A CPU proxy of the peak-memory target (under 1 MB at B*T = 16384): forward + backward of the in-place
    grad-in-forward path allocate nothing larger than the per-row loss / metric terms and 44 bytes a token in all
    (590 KB at 16384 tokens, plus scalars), and the gradient is the logits buffer."""
    import grpo_kernels.kernels.launch as launch_module

    real = launch_module.launch

    def launch_without_recording(*args, **kwargs):
        with _disable_current_modes():
            real(*args, **kwargs)
    from grpo_kernels.kernels import logits_loss_kernels
    monkeypatch.setattr(logits_loss_kernels, "launch", launch_without_recording)
    case = next(c for c in CASES if c.id == "everything")
    config = case.config.replace(top_entropy_quantile=1.0, off_policy_mask_threshold=None)
    B, T, V = 4, 16, 40
    inputs = make_inputs(case, B=B, T=T, V=V, dtype=torch.bfloat16)
    inputs.pop("sampling_logps")
    x = inputs["logits"].clone().requires_grad_(True)
    x.grad = None
    recorder = _Allocations()
    with recorder:
        loss, _ = gk.grpo_loss(x, inputs["ids"], inputs["advantages"], inputs["mask"], config=config,
                               impl="triton", inplace_backward=True, **optional_inputs(inputs))
        loss.backward()
    assert x.grad.data_ptr() == x.data_ptr()
    assert recorder.largest[0] <= N_TERMS * B * T, f"largest new tensor: {recorder.largest}"
    # per token: the loss / metric terms (28 bytes), the float mask and the reduction weights (4 + 4), and the
    # boolean masks of the on-device value checks (is_ratio: 5, ids in [0, V): 3; freed at once) = 44, plus scalars
    assert recorder.total_bytes <= 44 * B * T + 640, f"{recorder.total_bytes} bytes allocated for {B * T} tokens"


def test_scale_skips_on_one_and_keeps_padded_zeros():
    """The backward's device-side scaling: grad_output 1 leaves the buffer untouched, 0.5 halves valid rows."""
    from grpo_kernels.kernels.logits_loss_kernels import scale_dlogits_
    d = torch.randn(2, 3, 40).to(torch.bfloat16)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    d[mask == 0] = 0.0
    before = d.clone()
    scale_dlogits_(d, torch.tensor(1.0), mask)
    assert torch.equal(d, before)
    scale_dlogits_(d, torch.tensor(0.5), mask)
    assert torch.equal(d, before * 0.5)
