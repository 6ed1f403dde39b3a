"""Host syncs per call (docs/api.md, "Host syncs"): a default call of each public function, forward and backward,
reads the device at most once (the valid tokens per sequence, for the fused head's compaction), never inside a
chunk loop, and not at all with ``capturable=True`` (CUDA graph capture).

Counted on CPU tensors with a dispatch mode: the aten ops that wait for the device on a GPU (a scalar read, the
size of ``nonzero`` / ``masked_select`` / boolean-mask indexing, ``unique``...), plus ``Tensor.tolist``, which reads
without dispatching. The Triton paths run under the interpreter; their launches are asynchronous on a GPU."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_kernels as gk

from ..support.tolerances import assert_three_way, grad_scale

# aten ops that make the host wait for the device on a GPU
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique",
            "_unique2", "unique_dim", "unique_consecutive", "masked_scatter", "allclose", "bincount"}


def _bool_index(args) -> bool:
    """``x[mask]`` / ``x[mask] = v``: aten.index / index_put with a bool index (its size is data-dependent)."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices)


class SyncCounter(TorchDispatchMode):
    """Records every op that would be a device-to-host sync on a GPU, with where it was called."""

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        kwargs = kwargs or {}
        if name in SYNC_OPS or (name in ("index", "index_put", "index_put_") and _bool_index(args)) or (
                name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) and
                isinstance(args[0], torch.Tensor) and len(args) < 2):
            self.syncs.append(name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_syncs():
    counter = SyncCounter()
    real_tolist = torch.Tensor.tolist

    def tolist(self):
        counter.syncs.append("tolist")
        return real_tolist(self)

    torch.Tensor.tolist = tolist
    try:
        with counter:
            yield counter.syncs
    finally:
        torch.Tensor.tolist = real_tolist


B, T, V, H = 3, 5, 37, 8


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, 1:] = False
    return dict(hidden=torch.randn(B, T, H, generator=g), weight=torch.randn(V, H, generator=g) / 3,
                logits=torch.randn(B, T, V, generator=g), ids=torch.randint(0, V, (B, T), generator=g),
                mask=mask, adv=torch.randn(B, generator=g),
                old=torch.randn(B, T, generator=g) - 3, ref=torch.randn(B, T, generator=g) - 3)


CONFIGS = {  # config overrides -> the path they take on the Triton impl at these shapes (knobs below)
    "token-level": dict(loss_type="dapo", beta=0.04),
    "sequence-level": dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence"),
    "entropy-mask": dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.01),
    "no-grad-in-forward": dict(loss_type="bnpo", grad_in_forward=False),
}


def _head_loss(b, impl, **cfg):
    h, w = b["hidden"].clone().requires_grad_(True), b["weight"].clone().requires_grad_(True)
    loss, metrics = gk.fused_linear_grpo_loss(h, w, b["ids"], b["adv"], b["mask"], old_logps=b["old"],
                                              ref_logps=b["ref"], impl=impl, **cfg)
    loss.backward()
    return loss, metrics


def _logits_loss(b, impl, **cfg):
    x = b["logits"].clone().requires_grad_(True)
    loss, metrics = gk.grpo_loss(x, b["ids"], b["adv"], b["mask"], old_logps=b["old"], ref_logps=b["ref"],
                                 impl=impl, **cfg)
    loss.backward()
    return loss, metrics


def _head_logprobs(b, impl, capturable=False):
    h = b["hidden"].clone().requires_grad_(True)
    logp, ent = gk.linear_token_logprobs(h, b["weight"], b["ids"], mask=b["mask"], impl=impl, return_entropy=True,
                                         capturable=capturable)
    (logp.sum() + ent.sum()).backward()
    with torch.no_grad():
        gk.linear_token_logprobs(b["hidden"], b["weight"], b["ids"], mask=b["mask"], impl=impl, capturable=capturable)
    return logp, h.grad


def _logits_logprobs(b, impl):
    x = b["logits"].clone().requires_grad_(True)
    logp, ent = gk.token_logprobs(x, b["ids"], return_entropy=True, impl=impl)
    (logp.sum() + ent.sum()).backward()
    return logp, x.grad


@pytest.fixture(autouse=True)
def _small_fast_path(knobs):
    knobs(fast_path_min_rows=1)  # the fast head paths at these small shapes


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_loss_calls_sync_at_most_once_and_never_when_capturable(config, impl, plans):
    b = _batch()
    with counting_syncs() as syncs:
        _head_loss(b, impl, **CONFIGS[config])
    head_path = plans[-1].path
    assert len(syncs) <= 1, f"fused_linear_grpo_loss on {head_path}: syncs {syncs}"
    with counting_syncs() as syncs:
        _logits_loss(b, impl, **CONFIGS[config])
    assert syncs == [], f"grpo_loss on {plans[-1].path}: syncs {syncs}"
    with counting_syncs() as syncs:
        _head_loss(b, impl, capturable=True, **CONFIGS[config])
    assert syncs == [], f"fused_linear_grpo_loss(capturable=True) on {plans[-1].path}: syncs {syncs}"


def test_the_paths_above_are_every_path(plans):
    """The configurations above reach every path the planner has on one device."""
    b = _batch()
    for impl in ("triton", "torch"):
        for cfg in CONFIGS.values():
            _head_loss(b, impl, **cfg)
            _logits_loss(b, impl, **cfg)
        _head_logprobs(b, impl)
        _logits_logprobs(b, impl)
    from grpo_kernels import paths
    expected = {paths.LOGITS_FAST, paths.LOGITS_SWEEP, paths.LOGITS_TORCH, paths.HEAD_FAST, paths.HEAD_FAST_SEQUENCE,
                paths.HEAD_LIGHT, paths.HEAD_NO_GRAD, paths.HEAD_TORCH}
    assert expected <= {p.path for p in plans}


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_logprob_calls_sync_at_most_once_and_never_when_capturable(impl):
    b = _batch()
    with counting_syncs() as syncs:
        _head_logprobs(b, impl)
    assert len(syncs) <= 2, f"linear_token_logprobs (a call with grad, one without): {syncs}"
    with counting_syncs() as syncs:
        _head_logprobs(b, impl, capturable=True)
    assert syncs == []
    with counting_syncs() as syncs:
        _logits_logprobs(b, impl)
    assert syncs == []


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_capturable_gives_the_compacted_call_s_numbers(impl):
    """capturable=True computes the padded rows too; the loss, metrics and gradients are the default call's: the same
    maths on the same valid rows, the padded rows adding exact zeros in another chunking, so only the order of the
    fp32 sums differs. Three-way rule: capturable within K times the default call's error against the float64
    PyTorch path, plus ATOL."""
    b = _batch()
    b64 = {k: (v.double() if v.is_floating_point() else v) for k, v in b.items()}
    for cfg in CONFIGS.values():
        h, w = (b[k].clone().requires_grad_(True) for k in ("hidden", "weight"))
        h2, w2 = (b[k].clone().requires_grad_(True) for k in ("hidden", "weight"))
        outs = []
        for hh, ww, cap in ((h, w, False), (h2, w2, True)):
            loss, metrics = gk.fused_linear_grpo_loss(hh, ww, b["ids"], b["adv"], b["mask"], old_logps=b["old"],
                                                      ref_logps=b["ref"], impl=impl, capturable=cap, **cfg)
            loss.backward()
            outs.append((loss.detach(), metrics))
        h64, w64 = (b64[k].clone().requires_grad_(True) for k in ("hidden", "weight"))
        loss64, metrics64 = gk.fused_linear_grpo_loss(h64, w64, b64["ids"], b64["adv"], b64["mask"],
                                                      old_logps=b64["old"], ref_logps=b64["ref"], impl="torch", **cfg)
        loss64.backward()
        assert_three_way(outs[1][0], outs[0][0], loss64, torch.float32, "capturable loss")
        for k in outs[0][1]:
            assert_three_way(outs[1][1][k], outs[0][1][k], metrics64[k], torch.float32, f"capturable {k}")
        for name, ours, default, truth in (("d hidden", h2, h, h64), ("d weight", w2, w, w64)):
            assert_three_way(ours.grad, default.grad, truth.grad, torch.float32, f"capturable {name}",
                             scale=grad_scale(truth.grad))
    logp, grad = _head_logprobs(b, impl)
    logp_c, grad_c = _head_logprobs(b, impl, capturable=True)
    logp64, grad64 = _head_logprobs(b64, "torch")
    assert_three_way(logp_c, logp, logp64, torch.float32, "capturable log-probs")
    assert_three_way(grad_c, grad, grad64, torch.float32, "capturable d hidden", scale=grad_scale(grad64))


def test_the_counter_sees_a_sync():
    """The counter can fail: a scalar read, a boolean-mask index and a tolist are each counted."""
    x = torch.randn(4)
    with counting_syncs() as syncs:
        float(x.sum())
        x[x > 0].sum()
        x.tolist()
        x * 2  # not a sync
    assert syncs == ["_local_scalar_dense", "index", "tolist"]
