"""A DeepSpeed ZeRO-3 partitioned lm_head through the fused head (``gather_head=``) and through ``patch_trl()``.

``FakeZero3`` partitions parameters the way ZeRO-3 does: outside a gather context ``param.data`` is an empty
tensor (``ds_status`` NOT_AVAILABLE), and the gather context, like ``deepspeed.zero.GatheredParameters``, restores
the full values and empties them again on exit, i.e. before autograd runs the backward. A head that does not
gather again in its backward then fails (negative controls below). The real DeepSpeed run (2 ranks, gloo, CPU) is
tests/distributed/test_dist_zero3_deepspeed.py.
"""
import contextlib
import enum

import pytest
import torch

from grpo_kernels import FusedLinearGRPOLoss, fused_linear_grpo_loss, linear_token_logprobs
from grpo_kernels.config import GRPOLossConfig
from tests.support.tiny_models import tiny_llama
from tests.support.tolerances import gamma


class Status(enum.Enum):  # mirrors deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
    AVAILABLE = 1
    NOT_AVAILABLE = 2


class FakeZero3:
    """ZeRO-3's partitioning of the given parameters, on one process: empty ``.data`` outside ``gather``."""

    def __init__(self, *params):
        self.full = {}
        self.entries = 0  # gather contexts that actually gathered
        for i, p in enumerate(params):
            self.full[id(p)] = p.data
            p.ds_id, p.ds_status, p.ds_shape = i, Status.NOT_AVAILABLE, p.data.shape
            p.data = torch.empty(0, dtype=p.dtype)

    @contextlib.contextmanager
    def gather(self, *params):
        todo = [p for p in params if p is not None and p.ds_status != Status.AVAILABLE]
        self.entries += bool(todo)
        for p in todo:
            p.data, p.ds_status = self.full[id(p)], Status.AVAILABLE
        try:
            yield
        finally:
            for p in todo:
                p.data, p.ds_status = torch.empty(0, dtype=p.dtype), Status.NOT_AVAILABLE


def _inputs(dtype, B=3, T=5, H=12, V=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    bias = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    adv = torch.randn(B, generator=g)
    return hidden, weight, bias, ids, mask, adv


def _call(op, hidden, weight, bias, ids, mask, adv, impl, **kw):
    if op == "logprobs":
        logp, ent = linear_token_logprobs(hidden, weight, ids, bias=bias, temperature=0.7, return_entropy=True,
                                          impl=impl, mask=mask, **kw)
        return (logp.double() * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum() + 0.3 * ent.double().sum()
    cfg = GRPOLossConfig(loss_type="dapo", temperature=0.7, entropy_coef=0.05, grad_in_forward=op == "loss_in_forward")
    if op == "module":  # the nn.Module takes the keyword through to the function
        return FusedLinearGRPOLoss(cfg, impl=impl)(hidden, weight, ids, advantages=adv, mask=mask, bias=bias, **kw)[0]
    loss, _ = fused_linear_grpo_loss(hidden, weight, ids, adv, mask=mask, bias=bias, config=cfg, impl=impl, **kw)
    return loss


# (op, impl, dtype): the recompute backward (both impls) and the Triton gradient-in-forward path
CASES = [("logprobs", "torch", torch.float64), ("loss", "torch", torch.float64), ("logprobs", "triton", torch.float32),
         ("loss", "triton", torch.float32), ("loss_in_forward", "triton", torch.float32),
         ("module", "torch", torch.float64)]


@pytest.mark.parametrize("op,impl,dtype", CASES)
def test_gather_head_matches_unsharded(op, impl, dtype):
    """Loss, d hidden, d weight and d bias from a partitioned head equal the unsharded call's."""
    hidden, weight, bias, ids, mask, adv = _inputs(dtype)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref = _call(op, *leaves, ids, mask, adv, impl)
    ref_grads = torch.autograd.grad(ref, leaves)

    h = hidden.clone().requires_grad_()
    w, b = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())
    zero3 = FakeZero3(w, b)
    value = _call(op, h, w, b, ids, mask, adv, impl, gather_head=lambda: zero3.gather(w, b))
    assert w.numel() == 0 and b.numel() == 0  # partitioned again after the forward
    grads = torch.autograd.grad(value, [h, w, b])
    # forward and, on the recompute paths, the backward gathered; the gradient-in-forward path needs no backward read
    assert zero3.entries == (1 if op == "loss_in_forward" else 2)
    # the gather hands the kernels the very values of the unsharded weight: the same code on the same inputs, the
    # same bits
    assert torch.equal(value, ref)
    for name, g, g_ref in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.shape == g_ref.shape, name
        assert torch.equal(g, g_ref), f"d {name}"


@pytest.mark.parametrize("op,impl", [("logprobs", "torch"), ("loss", "torch"), ("logprobs", "triton")])
def test_without_gather_in_backward_fails(op, impl):
    """Negative control: gathering only around the forward (as the caller of a head without ``gather_head`` would)
    leaves the backward with the emptied partition."""
    hidden, weight, bias, ids, mask, adv = _inputs(torch.float64 if impl == "torch" else torch.float32)
    h = hidden.clone().requires_grad_()
    w, b = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())
    zero3 = FakeZero3(w, b)
    with zero3.gather(w, b):
        value = _call(op, h, w, b, ids, mask, adv, impl)
    with pytest.raises((RuntimeError, AssertionError)):  # a shape error in a matmul or a launcher's check
        torch.autograd.grad(value, [h, w, b])


def test_gather_head_errors():
    hidden, weight, bias, ids, mask, adv = _inputs(torch.float64)
    with pytest.raises(ValueError, match="gather_head must be None or a zero-argument callable"):
        linear_token_logprobs(hidden, weight, ids, gather_head=object())
    with pytest.raises(ValueError, match="gather_head must be None or a zero-argument callable"):
        fused_linear_grpo_loss(hidden, weight, ids, adv, gather_head=42)
    with pytest.raises(ValueError, match=r"gather_head\(\) must return a context manager"):
        linear_token_logprobs(hidden, weight, ids, gather_head=lambda: None)
    with pytest.raises(ValueError, match="gather_head cannot be combined with process_group"):
        linear_token_logprobs(hidden, weight, ids, gather_head=contextlib.nullcontext, process_group=object())


# ------------------------------------------------------------------------------------------------ through TRL

def _trl_head_grads(patched: bool, partitioned: bool, monkeypatch):
    """(log_probs, entropy, d lm_head.weight, d hidden-side param) of TRL's fused forward on a tiny Llama."""
    import transformers.integrations.deepspeed as hf_ds
    import trl.trainer.utils as trl_utils

    from grpo_kernels.integrations.trl import patch_trl, unpatch_trl

    model = tiny_llama(dtype=torch.float64)
    trl_utils.add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
    head = model.lm_head.weight
    if partitioned:
        zero3 = FakeZero3(head)
        monkeypatch.setattr(hf_ds, "is_deepspeed_zero3_enabled", lambda: True)
        monkeypatch.setattr(trl_utils, "maybe_gather_lm_head_ctx", zero3.gather)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 43, (2, 9), generator=g)
    labels = input_ids.clone()
    labels[0, :3] = -100
    if patched:
        patch_trl(strict=True)
    try:
        out = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
        loss = (out.log_probs * torch.linspace(-1, 1, out.log_probs.numel()).view_as(out.log_probs)).sum() \
            + 0.2 * out.entropy.sum()
        norm = model.model.norm.weight
        d_head, d_norm = torch.autograd.grad(loss, [head, norm])
    finally:
        unpatch_trl()
        monkeypatch.undo()
    if partitioned:
        assert head.numel() == 0 and zero3.entries == 2  # TRL's forward gather, then the backward's
    return out.log_probs.detach(), out.entropy.detach(), d_head, d_norm


def test_trl_zero3_stays_on_fused_head(monkeypatch):
    """patch_trl(strict=True) no longer refuses ZeRO-3: the partitioned head gives exactly the unsharded patched
    numbers, and TRL's own (whose fold accumulates in fp32, returning fp32 log-probs) to fp32 precision."""
    import grpo_kernels

    calls = []
    original = grpo_kernels.linear_token_logprobs
    monkeypatch.setattr(grpo_kernels, "linear_token_logprobs", lambda *a, **k: calls.append(k) or original(*a, **k))
    ours = _trl_head_grads(True, True, monkeypatch)
    assert len(calls) == 1 and callable(calls[0]["gather_head"])
    trl_own = _trl_head_grads(False, True, monkeypatch)
    unsharded = _trl_head_grads(True, False, monkeypatch)
    # ours runs the float64 model in float64; TRL's own accumulates in fp32: each of its values comes from at most
    # N * V + H = 18 * 43 + 16 rounded operations, so it is within gamma_790 (Higham) of the float64 result, relative to
    # the tensor's largest value. The partitioned and the unsharded patched calls run the same code on the same values.
    for a, b, c in zip(ours, trl_own, unsharded):
        bound = gamma(18 * 43 + 16)
        torch.testing.assert_close(a, b.to(a.dtype), rtol=bound, atol=bound * a.abs().max().item())
        assert torch.equal(a, c)


def test_zero3_gather_head_without_zero3(monkeypatch):
    """Plain tensors (no ZeRO-3): a no-op context that never imports deepspeed, so one model code runs with and
    without DeepSpeed; ZeRO-3 partitions with deepspeed not importable: an ImportError that says so."""
    import sys

    from grpo_kernels import zero3_gather_head

    weight = torch.randn(5, 3, requires_grad=True)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError
    gather_head = zero3_gather_head(weight, None)
    with gather_head():
        pass
    hidden, ids = torch.randn(4, 3, requires_grad=True), torch.tensor([0, 4, 2, 1])
    assert torch.equal(linear_token_logprobs(hidden, weight, ids, gather_head=gather_head),  # a no-op context
                       linear_token_logprobs(hidden, weight, ids))
    weight.ds_id = 7  # what a ZeRO-3 partition carries
    with pytest.raises(ImportError, match="zero3_gather_head: the head's parameters are DeepSpeed ZeRO-3 partitions"):
        zero3_gather_head(weight)()


def test_zero3_gather_head_refuses_a_head_in_flight():
    """A partition ZeRO-3 is prefetching (INFLIGHT) is refused up front with a message naming the helper, instead
    of DeepSpeed's assertion on exit after the whole head has run."""
    partition_parameters = pytest.importorskip(
        "deepspeed.runtime.zero.partition_parameters", reason="deepspeed is a test extra (pip install -e .[test])")
    from grpo_kernels import zero3_gather_head

    weight = torch.nn.Parameter(torch.empty(0))
    weight.ds_id, weight.ds_status = 3, partition_parameters.ZeroParamStatus.INFLIGHT
    with pytest.raises(RuntimeError, match="zero3_gather_head: 1 head parameter.*INFLIGHT"):
        zero3_gather_head(weight, None)()


# ------------------------------------------------------------------ through TRL's DistillationTrainer seam

def _trl_distill_grads(seam: str, patched: bool, partitioned: bool, monkeypatch):
    """(divergence or loss, d student hidden, d student weight, d student bias) of TRL's distillation seam ("loss":
    ``_chunked_divergence_loss`` as the trainer calls it; "function": ``ChunkedDivergenceFunction.apply``) in
    float64, both models' heads (V 37; H_s 12, H_t 20) ZeRO-3 partitions when ``partitioned``; and the gathers that
    gathered."""
    import transformers.integrations.deepspeed as hf_ds
    import trl.kernels.chunked_divergence as trl_kernel
    import trl.trainer.distillation_trainer as trl_distill
    import trl.trainer.utils as trl_utils

    from grpo_kernels.integrations.trl import patch_trl, unpatch_trl

    g = torch.Generator().manual_seed(2)
    sh = torch.randn(2, 6, 12, generator=g, dtype=torch.float64).requires_grad_()
    th = torch.randn(2, 6, 20, generator=g, dtype=torch.float64)
    sw, tw = (torch.nn.Parameter(torch.randn(37, h, generator=g, dtype=torch.float64) * 0.5) for h in (12, 20))
    sb, tb = (torch.nn.Parameter(torch.randn(37, generator=g, dtype=torch.float64)) for _ in range(2))
    tw.requires_grad_(False)
    tb.requires_grad_(False)
    mask = torch.rand(2, 6, generator=g) > 0.3
    zero3 = FakeZero3(sw, sb, tw, tb) if partitioned else None
    if partitioned:
        monkeypatch.setattr(hf_ds, "is_deepspeed_zero3_enabled", lambda: True)
        monkeypatch.setattr(trl_utils, "maybe_gather_lm_head_ctx", zero3.gather)
        monkeypatch.setattr(trl_kernel, "maybe_gather_lm_head_ctx", zero3.gather)  # TRL's function imported it
    if patched:
        patch_trl(strict=True)
    try:
        if seam == "loss":
            value = trl_distill._chunked_divergence_loss(sh, th, sw, tw, mask, 0.4, student_lm_head_bias=sb,
                                                         teacher_lm_head_bias=tb, student_final_logit_softcapping=5.0,
                                                         teacher_logit_scale=1.3, temperature=0.8)[0]
        else:
            div, _ = trl_distill.ChunkedDivergenceFunction.apply(sh.reshape(12, 12), sw, sb, th.reshape(12, 20), tw,
                                                                 tb, 0.4, 0.8, 1.0, 5.0, 1.3, None)
            value = (div * torch.linspace(0.5, 1.5, 12, dtype=div.dtype)).sum()
        grads = torch.autograd.grad(value, [sh, sw, sb])
    finally:
        unpatch_trl()
        monkeypatch.undo()
    if partitioned:
        assert sw.numel() == tw.numel() == 0  # partitioned again after the call
    return (value.detach(), *grads), (zero3.entries if partitioned else 0)


@pytest.mark.parametrize("seam", ["loss", "function"])
def test_trl_distillation_zero3_heads(seam, monkeypatch):
    """patch_trl(strict=True) serves partitioned student and teacher heads: each gathered by TRL's own context (the
    loss: once each, its gradient made in the forward; the function: again in its recompute backward), the same bits
    as unsharded, and TRL's own unsharded call (which accumulates in fp32) to fp32 precision. (TRL 1.16's own
    function on these partitions fails here: it gathers inside its forward, so autograd records the emptied
    parameter's shape and refuses its full-size gradient.)"""
    import grpo_kernels

    name = "fused_linear_distill_loss" if seam == "loss" else "linear_token_divergence"
    calls = []
    original = getattr(grpo_kernels, name)
    monkeypatch.setattr(grpo_kernels, name, lambda *a, **k: calls.append(k) or original(*a, **k))
    ours, entries = _trl_distill_grads(seam, True, True, monkeypatch)
    assert len(calls) == 1 and callable(calls[0]["gather_head"]) and callable(calls[0]["teacher_gather_head"])
    assert entries == (2 if seam == "loss" else 4)
    unsharded, _ = _trl_distill_grads(seam, True, False, monkeypatch)
    trl_own, _ = _trl_distill_grads(seam, False, False, monkeypatch)
    # TRL's own rounds to fp32: each value comes from at most N (V + H) + V = 12 (37 + 20) + 37 < 1024 rounded
    # operations on values no larger than the tensor's largest, so within gamma_1024 of the float64 result relative to
    # it (Higham). The partitioned and the unsharded patched calls run the same code on the same values.
    for a, b, c in zip(ours, trl_own, unsharded):
        bound = gamma(1024)
        torch.testing.assert_close(a, b.to(a.dtype), rtol=bound, atol=bound * a.abs().max().item())
        assert torch.equal(a, c)
