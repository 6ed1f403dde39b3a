"""inplace_backward=True on non-overlapping views of a larger logits buffer: ``logits[:, :-1]`` (the shifted
sequence every causal-LM caller scores), transposed, step-sliced and vocab-strided views, on every logits path.
The gradient equals the out-of-place call's and the view holds d logits afterwards. A box view (slices, also
transposed or permuted: ``grpo_kernels/inplace_views.py``) is rooted at its buffer, which becomes the buffer's
gradient: 0 outside the view, and no tensor of the buffer's size is allocated in the backward (traced below, for
every entry point that takes ``inplace_backward``, at batch sizes 1 and 3). Any other view (a step) keeps the
elements outside it untouched, and autograd's slice backward allocates the buffer's gradient. Overlap is decided
from sizes and strides (``_checks.overlaps_in_memory``): only real overlap (expand, as_strided onto itself) is
refused."""
import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.paths import LOGITS_FAST, LOGITS_SWEEP, LOGITS_TORCH
from grpo_kernels.planner import common as planner_common
from grpo_kernels._checks import overlaps_in_memory
from grpo_kernels.explain import plan_call
from grpo_kernels.logits.logprobs import TORCH_LOGITS_TEMPS
from tests.support.cases import CASES, make_inputs

B, T, V = 3, 5, 37


def _view(kind: str, raw: torch.Tensor):
    """(buffer, view of it shaped (B, T, V)) for ``raw`` (B, T, V) values; the buffer is a non-leaf tensor (as a
    model's logits are) holding ``raw`` inside the view and other values outside it."""
    g = torch.Generator().manual_seed(11)
    if kind == "shifted":            # logits[:, :-1]: the caller's (B, T + 1, V) logits
        base = torch.randn(B, T + 1, V, generator=g)
        index = (slice(None), slice(0, T))
        make = lambda buf: buf[:, :-1]                                      # noqa: E731
    elif kind == "transposed":       # (T + 1, B, V) time-major logits, transposed and shifted
        base = torch.randn(T + 1, B, V, generator=g)
        index = (slice(1, T + 1),)
        make = lambda buf: buf.transpose(0, 1)[:, 1:]                       # noqa: E731
    elif kind == "step":             # every second position
        base = torch.randn(B, 2 * T, V, generator=g)
        index = (slice(None), slice(0, 2 * T, 2))
        make = lambda buf: buf[:, ::2]                                      # noqa: E731
    elif kind == "vocab-strided":    # vocab-major storage: the kernels' unit-stride rows need a private copy
        base = torch.randn(V + 3, B, T, generator=g)
        index = (slice(2, V + 2),)
        make = lambda buf: buf.permute(1, 2, 0)[..., 2:V + 2]               # noqa: E731
    else:
        raise AssertionError(kind)
    base = base.to(raw.dtype)
    make(base).copy_(raw)
    assert not overlaps_in_memory(make(base)) and not make(base).is_contiguous()
    return base, index, make


KINDS = ["shifted", "transposed", "step", "vocab-strided"]
ROOTED = ("shifted", "transposed", "vocab-strided")  # box views: the buffer becomes its own gradient
# (function, impl, grad_in_forward, importance_sampling_level) -> the path the planner picks
PATHS = {
    "token_logprobs-torch": ("token_logprobs", "torch", True, "token", LOGITS_TORCH),
    "token_logprobs-triton": ("token_logprobs", "triton", True, "token", LOGITS_SWEEP),
    "grpo_loss-torch": ("grpo_loss", "torch", True, "token", LOGITS_TORCH),
    "grpo_loss-triton-fast": ("grpo_loss", "triton", True, "token", LOGITS_FAST),
    "grpo_loss-triton-sweep": ("grpo_loss", "triton", False, "token", LOGITS_SWEEP),
    "grpo_loss-triton-sequence": ("grpo_loss", "triton", True, "sequence", LOGITS_SWEEP),
}


def _run(path: str, kind: str, raw, inputs, inplace: bool, knobs, plans):
    """Forward + backward of ``path`` on the ``kind`` view; returns (grad of the buffer's leaf, buffer after)."""
    fn, impl, gif, level, _ = PATHS[path]
    leaf, index, make = _view(kind, raw)
    leaf = leaf.requires_grad_(True)
    buffer = leaf * 1.0              # a non-leaf buffer, as a model's logits
    view = make(buffer)
    knobs(max_block_v=16)            # the Triton sweeps cross vocab-block boundaries and a tail
    budget = None
    if impl == "torch":              # several row chunks: room for 2 rows of temporaries beside the rest
        probe = plan_call(gk.token_logprobs, view.detach(), inputs["ids"], impl="torch")
        budget = probe.transient_bytes - (probe.chunk_rows - 2) * TORCH_LOGITS_TEMPS * 4 * V
    if fn == "token_logprobs":
        logp, entropy = gk.token_logprobs(view, inputs["ids"], temperature=0.8, return_entropy=True, impl=impl,
                                          inplace_backward=inplace, memory_budget=budget)
        out = (logp * inputs["advantages"][:, None]).sum() + 0.3 * (entropy * inputs["mask"]).sum()
    else:
        rest = {k: inputs[k] for k in ("old_logps", "ref_logps") if k in inputs}
        out, _ = gk.grpo_loss(view, inputs["ids"], inputs["advantages"], inputs["mask"], impl=impl,
                              inplace_backward=inplace, loss_type="grpo", beta=0.04, epsilon_high=0.28,
                              temperature=0.8, grad_in_forward=gif, importance_sampling_level=level,
                              memory_budget=budget, **rest)
    (2.0 * out).backward()           # a scaled loss: the fast path's backward rescales the stored gradient
    if impl == "torch":
        assert plans[-1].chunk_rows == 2, plans[-1]
    assert plans[-1].path == PATHS[path][4], plans[-1]
    return leaf.grad, buffer.detach(), index, make


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", list(PATHS))
def test_inplace_on_a_view_matches_out_of_place(path, kind, knobs, plans):
    impl = PATHS[path][1]
    if impl == "triton":
        pytest.importorskip("triton")
    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    inputs = make_inputs(case, B=B, T=T, V=V, seed=4)
    raw = inputs.pop("logits")
    expected, untouched, _, _ = _run(path, kind, raw, inputs, False, knobs, plans)
    grad, after, index, make = _run(path, kind, raw, inputs, True, knobs, plans)
    assert torch.equal(grad, expected), (grad - expected).abs().max()
    # the view holds d logits (the gradient of the view); the rest of the buffer is its gradient too (0) when the
    # view was rooted at it, else as it was
    assert torch.equal(make(after), make(expected))
    outside = torch.ones_like(after, dtype=torch.bool)
    make(outside).fill_(False)
    rest = torch.zeros_like(untouched) if kind in ROOTED else untouched
    assert outside.any() and torch.equal(after[outside], rest[outside])
    # the out-of-place call left the whole buffer alone
    assert torch.equal(make(untouched), raw)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_token_logprobs_on_a_row_slice_of_2d_logits(impl):
    """(N, V) logits sliced out of a wider, taller buffer: written in place, the rest of the buffer 0 (its
    gradient)."""
    g = torch.Generator().manual_seed(2)
    leaf = torch.randn(9, V + 4, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (7,), generator=g)
    expected = torch.autograd.grad(gk.token_logprobs(leaf[1:8, 2:V + 2], ids, impl=impl).sum(), leaf)[0]
    buffer = leaf * 1.0
    gk.token_logprobs(buffer[1:8, 2:V + 2], ids, impl=impl, inplace_backward=True).sum().backward()
    assert torch.equal(leaf.grad, expected)
    assert torch.equal(buffer.detach(), expected)


def test_overlap_is_decided_from_sizes_and_strides():
    x = torch.zeros(2, 5, 7)
    for fine in (x, x[:, :-1], x[:, ::2], torch.zeros(5, 2, 7).transpose(0, 1), x[..., 1:4],
                 torch.zeros(7, 2, 5).permute(1, 2, 0), torch.zeros(1, 1, 7).expand(1, 1, 7), torch.zeros(0, 3),
                 x.as_strided((2, 3), (10, 3))):
        assert not overlaps_in_memory(fine), (tuple(fine.shape), fine.stride())
    for bad in (torch.zeros(1, 1, 7).expand(2, 3, 7), x.as_strided((2, 5, 7), (7, 7, 1)), x.unfold(2, 3, 1),
                x.as_strided((4, 4), (1, 1))):
        assert overlaps_in_memory(bad), (tuple(bad.shape), bad.stride())


@pytest.mark.parametrize("make", [lambda x: x[:1, :1].expand(2, 3, 11), lambda x: x.as_strided((2, 3, 11), (0, 11, 1)),
                                  lambda x: x.as_strided((2, 3, 11), (11, 5, 1))],
                         ids=["expanded", "as_strided-zero-stride", "as_strided-rows-overlap"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_real_overlap_is_refused(make, impl):
    logits = make(torch.randn(2, 3, 11))
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="inplace_backward"):
        gk.grpo_loss(logits, ids, torch.ones(2), inplace_backward=True, impl=impl)
    with pytest.raises(ValueError, match="inplace_backward"):
        gk.token_logprobs(logits, ids, inplace_backward=True, impl=impl)


def _shifted_loss(entry: str, impl: str, logits, ids, adv, mask):
    """A scalar to backpropagate from ``entry`` called on the shifted view ``logits[:, :-1]`` with in-place d logits
    (Liger's ``triton_grpo_loss`` takes the whole (B, T + 1, V) buffer and slices it itself)."""
    from grpo_kernels import liger

    view = logits[:, :-1]
    if entry == "token_logprobs":
        logp, ent = gk.token_logprobs(view, ids, impl=impl, return_entropy=True, inplace_backward=True)
        return (logp * adv[:, None]).sum() + 0.1 * ent.sum()
    if entry.startswith("grpo_loss"):
        return gk.grpo_loss(view, ids, adv, mask, impl=impl, inplace_backward=True, beta=0.0,
                            grad_in_forward=entry == "grpo_loss")[0]
    if entry == "GRPOLoss":
        return gk.GRPOLoss(impl=impl)(view, ids, adv, mask, inplace_backward=True)[0]
    # Liger's own entry point: its default inplace=True, the impl GRPO_KERNELS_IMPL names
    loss = liger.triton_grpo_loss(logits, None, None, ids, adv, mask, beta=0.0, reduce=entry.endswith("reduce"))[0]
    return loss if loss.dim() == 0 else loss.sum()


ENTRIES = ["token_logprobs", "grpo_loss", "grpo_loss-sweep", "GRPOLoss", "liger.triton_grpo_loss",
           "liger.triton_grpo_loss-reduce"]


@pytest.mark.parametrize("B_", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_shifted_logits_in_place_allocate_no_logits_sized_tensor(entry, impl, B_, monkeypatch):
    """Every entry point taking in-place d logits, on ``logits[:, :-1]`` of a model-like (B, T + 1, V) buffer (the
    output of ``hidden @ W.T``): the gradients equal the out-of-place call's, and no single allocation during the
    forward and backward is as large as B x T x V logits (the slice backward's fresh B x (T + 1) x V gradient, or a
    contiguous copy of the view, would be)."""
    from tests.support.memory_trace import memory_events

    if entry.startswith("liger"):
        monkeypatch.setenv("GRPO_KERNELS_IMPL", impl)
    # a default budget small enough that the PyTorch path's row chunks (fp32 temporaries) stay below the logits' size
    monkeypatch.setattr(planner_common, "DEFAULT_WORKING_BYTES", 1 << 14)  # where Budget reads it
    Tn, Vn, Hn = 16, 512, 2  # the weight gradient (V x H) and the torch path's chunks stay below the logits
    g = torch.Generator().manual_seed(B_)
    hidden0 = torch.randn(B_, Tn + 1, Hn, generator=g)
    weight0 = torch.randn(Vn, Hn, generator=g) / 2
    ids = torch.randint(0, Vn, (B_, Tn), generator=g)
    adv, mask = torch.randn(B_, generator=g), torch.ones(B_, Tn)
    grads = []
    for inplace in (False, True):
        hidden, weight = hidden0.clone().requires_grad_(True), weight0.clone().requires_grad_(True)
        logits = hidden @ weight.T
        if not inplace:  # the reference: the same call out of place (a clone: nothing is written back)
            loss = _shifted_loss_out_of_place(entry, impl, logits, ids, adv, mask)
            loss.backward()
        else:
            events = memory_events(lambda: _shifted_loss(entry, impl, logits, ids, adv, mask).backward())
            largest = max((n for _, n in events if n > 0), default=0)
            assert largest < B_ * Tn * Vn * logits.element_size(), \
                f"{entry}: an allocation of {largest} B, the logits are {B_ * Tn * Vn * logits.element_size()} B"
        grads.append((hidden.grad, weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(b, a), (b - a).abs().max()


def _shifted_loss_out_of_place(entry, impl, logits, ids, adv, mask):
    from grpo_kernels import liger

    view = logits[:, :-1]
    if entry == "token_logprobs":
        logp, ent = gk.token_logprobs(view, ids, impl=impl, return_entropy=True)
        return (logp * adv[:, None]).sum() + 0.1 * ent.sum()
    if entry.startswith("grpo_loss") or entry == "GRPOLoss":
        return gk.grpo_loss(view, ids, adv, mask, impl=impl, beta=0.0, grad_in_forward=entry != "grpo_loss-sweep")[0]
    loss = liger.triton_grpo_loss(logits, None, None, ids, adv, mask, beta=0.0, reduce=entry.endswith("reduce"),
                                  inplace=False)[0]
    return loss if loss.dim() == 0 else loss.sum()
