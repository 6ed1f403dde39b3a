"""``grpo_kernels.liger``: Liger-Kernel 0.8.5's GRPO entry points on grpo_kernels (issue 30).

Checked against Liger's own code, installed (the test extra): the constructor / forward / function signatures
are Liger's, parameter for parameter; the numbers are compared with Liger's torch definition
(``LigerFusedLinearGRPOFunction.ppo_loss_fn``) evaluated in float64 as ground truth, with Liger's own chunked
module (``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss``) in the same dtype as the middle term of the
three-way rule (tests/support/tolerances.py), on the cases where Liger's definitions and TRL's agree. Where they do not,
a test pins each documented difference (docs/api.md, "Coming from Liger-Kernel") and that ours is TRL's.
"""
import inspect
import warnings

import pytest
import torch

from tests.support.cases import CASES, Case, make_inputs
from tests.support.tolerances import assert_same_maths, assert_three_way

liger_grpo = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss", reason="needs liger-kernel (test extra)")
from grpo_kernels import liger as ours  # noqa: E402
from grpo_kernels.loss_types import LOSS_TABLE  # noqa: E402

H = 16


def _liger_kwargs(cfg, T, **extra):
    """Liger's module options from one of our configs (max_completion_length given: Liger requires it for dr_grpo)."""
    return dict(beta=cfg.beta, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, loss_type=cfg.loss_type,
                max_completion_length=cfg.max_completion_length or T,
                importance_sampling_level=cfg.importance_sampling_level,
                sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
                temperature=cfg.temperature, delta=cfg.delta, use_bias_correction_kl=cfg.use_bias_correction_kl,
                vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
                vespo_lambda_neg=cfg.vespo_lambda_neg, **extra)


def _liger_definition(logps, mask, adv, kw, old=None, ref=None, is_ratio=None, num_items=None):
    """Liger's torch definition of the loss and its metrics (``ppo_loss_fn``) on given per-token log-probs: the
    whole batch is one chunk, so the chunked module's sums are this call's."""
    if is_ratio is not None and is_ratio.dim() == 1:
        is_ratio = is_ratio.unsqueeze(-1)  # as Liger's module does before chunking
    kw = {k: v for k, v in kw.items() if k not in ("temperature", "compiled", "chunk_size", "use_ref_model")}
    return liger_grpo.LigerFusedLinearGRPOFunction.ppo_loss_fn(
        per_token_logps=logps, attention_mask=mask, advantages=adv, full_attention_mask=mask,
        ref_per_token_logps=ref, old_per_token_logps=old, vllm_is_ratio=is_ratio, num_items_in_batch=num_items, **kw)


def _logps(logits, ids, temperature):
    return torch.log_softmax(logits / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def clip_metric_agrees(cfg, mask) -> bool:
    """Whether Liger's clip metric has TRL's definition here (docs/api.md lists the cases where it does not)."""
    policy = LOSS_TABLE[cfg.loss_type].policy
    return (policy in ("clipped", "cispo")
            and (cfg.importance_sampling_level == "token" or bool(mask.all()))
            and (cfg.delta is None or cfg.delta > 1 + cfg.epsilon_high))


# The cases where Liger's loss and gradients have TRL's definition: no entropy / off-policy masks or entropy bonus
# (Liger has none), no (B, T) advantages (Liger's chunks broadcast them wrongly), luspo only without padding,
# no sequence-level sapo (Liger refuses it).
AGREE = [c for c in CASES if c.config.top_entropy_quantile == 1.0 and c.config.entropy_coef == 0.0
         and c.config.off_policy_mask_threshold is None and not c.adv_2d and c.config.loss_type != "luspo"
         and not (c.config.importance_sampling_level == "sequence" and c.config.loss_type == "sapo")]
EXTRA = [  # (case, variant): drop-in-only inputs
    (Case("luspo-full-mask", {"loss_type": "luspo", "beta": 0.04}, ref=True), "full-mask"),
    (Case("delta-above-clip", {"loss_type": "dapo", "delta": 1.5, "epsilon_high": 0.28}), ""),
    (Case("ref-input", {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": True}, ref=True), "ref-input"),
    (Case("bias-no-ref-model", {"loss_type": "bnpo", "beta": 0.04}), "bias,no-ref-model"),
]
FUSED = [(c, "") for c in AGREE] + EXTRA


def _head_inputs(case, variant, dtype, seed=3):
    inputs = make_inputs(case, hidden_size=H, seed=seed)
    B, T = inputs["ids"].shape
    if "full-mask" in variant:
        inputs["mask"] = torch.ones(B, T, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed + 1)
    if "bias" in variant:
        inputs["bias"] = torch.randn(inputs["weight"].shape[0], generator=g) * 0.3
    if "ref-input" in variant:  # reference model: perturbed hidden states and head
        inputs["ref_input"] = inputs["hidden"] + 0.1 * torch.randn(inputs["hidden"].shape, generator=g)
        inputs["ref_weight"] = inputs["weight"] + 0.05 * torch.randn(inputs["weight"].shape, generator=g)
        inputs.pop("ref_logps")
    for k in ("hidden", "weight", "bias", "ref_input", "ref_weight"):
        if k in inputs:
            inputs[k] = inputs[k].to(dtype)
    return inputs


def _run_module(module, inputs, dtype):
    """forward + backward of a Liger-signature module, positionally as Liger's users call it."""
    leaves = {k: inputs[k].detach().to(dtype).requires_grad_(True) for k in ("hidden", "weight", "bias")
              if k in inputs}
    loss, metrics = module(leaves["hidden"], leaves["weight"], inputs["ids"], inputs["mask"].long(),
                           inputs["advantages"], leaves.get("bias"), inputs.get("ref_logps"), inputs.get("old_logps"),
                           inputs.get("ref_input"), inputs.get("ref_weight"), None, inputs.get("is_ratio"),
                           inputs.get("num_items_in_batch"))
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.detach(), [m.detach() for m in metrics], dict(zip(leaves, grads))


def _truth(inputs, kw, use_ref_model=True):
    """Liger's definition in float64: log-probs from the float64 head, ``ppo_loss_fn``, autograd gradients."""
    leaves = {k: inputs[k].detach().double().requires_grad_(True) for k in ("hidden", "weight", "bias")
              if k in inputs}
    logits = leaves["hidden"] @ leaves["weight"].T + (leaves["bias"] if "bias" in leaves else 0.0)
    logps = _logps(logits, inputs["ids"], kw["temperature"])
    ref = inputs.get("ref_logps")
    if "ref_input" in inputs:
        ref = _logps(inputs["ref_input"].double() @ inputs["ref_weight"].double().T, inputs["ids"],
                     kw["temperature"])
    ref = (ref.double() if ref is not None else None) if use_ref_model else None
    rest = {k: inputs[k].double() for k in ("old_logps", "is_ratio") if k in inputs}
    loss, metrics = _liger_definition(logps, inputs["mask"].double(), inputs["advantages"].double(), kw,
                                      old=rest.get("old_logps"), ref=ref, is_ratio=rest.get("is_ratio"),
                                      num_items=inputs.get("num_items_in_batch"))
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.detach(), [m.detach() for m in metrics], dict(zip(leaves, grads))


def _compare(mine, middle, truth, dtype, cfg, mask, what):
    (l1, m1, g1), (l2, m2, g2), (l0, m0, g0) = mine, middle, truth
    assert len(m1) == len(m0) == len(m2), (len(m1), len(m2), len(m0))
    assert_three_way(l1, l2, l0, dtype, f"{what}: loss")
    names = (["kl"] if len(m0) == 2 else []) + ["clip_ratio"]
    for name, a, b, t in zip(names, m1, m2, m0):
        if name == "kl" or clip_metric_agrees(cfg, mask):
            assert_three_way(a, b, t, dtype, f"{what}: {name}")
    for k in g0:
        assert_three_way(g1[k], g2[k], g0[k], dtype, f"{what}: d {k}")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case,variant", FUSED, ids=[c.id for c, _ in FUSED])
def test_fused_linear_matches_liger_reference(case, variant, impl, plans):
    """Loss, metrics and gradients of the drop-in against Liger's float64 definition, within twice the error of
    Liger's own chunked module in fp32 (plus fp32's atol)."""
    dtype = torch.float32
    inputs = _head_inputs(case, variant, dtype)
    T = inputs["ids"].shape[1]
    # Liger's use_ref_model=True (its default) asserts a reference input, even at beta = 0
    use_ref_model = "no-ref-model" not in variant and case.ref
    kw = _liger_kwargs(case.config, T, use_ref_model=use_ref_model)
    if "no-ref-model" in variant:
        inputs["ref_logps"] = torch.zeros_like(inputs["old_logps"])  # ignored by both
    mine = ours.LigerFusedLinearGRPOLoss(**kw)
    mine.impl = impl
    theirs = liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, **kw)
    _compare(_run_module(mine, inputs, dtype), _run_module(theirs, inputs, dtype),
             _truth(inputs, kw, use_ref_model), dtype, case.config, inputs["mask"], case.id)
    assert plans and all(p.impl == impl for p in plans), [(p.path, p.impl) for p in plans]


def test_bf16_head_is_at_least_as_accurate_as_liger():
    """Liger's reference rounds each logits tile to bf16 (its matmul runs in the input dtype); grpo_kernels keeps
    fp32 logits: against float64, ours stays within the three-way bound of Liger's bf16 error."""
    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    inputs = _head_inputs(case, "", torch.bfloat16)
    kw = _liger_kwargs(case.config, inputs["ids"].shape[1])
    mine = _run_module(ours.LigerFusedLinearGRPOLoss(**kw), inputs, torch.bfloat16)
    theirs = _run_module(liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, **kw), inputs, torch.bfloat16)
    truth = _truth(inputs, kw)
    _compare(mine, theirs, truth, torch.bfloat16, case.config, inputs["mask"], "bf16")
    assert abs(mine[0].item() - truth[0].item()) < abs(theirs[0].item() - truth[0].item())


# ------------------------------------------------------------------------------------------- triton_grpo_loss

def _logits_inputs(case, seed=5, B=3, T=6, V=41):
    inputs = make_inputs(case, B=B, T=T, V=V, seed=seed)
    g = torch.Generator().manual_seed(seed)
    # Liger's layout: one more position than completion tokens (its gradient is 0)
    inputs["logits"] = torch.cat([inputs["logits"], torch.randn(B, 1, V, generator=g)], dim=1)
    return inputs


def _triton_kwargs(cfg, T):
    kw = _liger_kwargs(cfg, T)
    return dict(temperature=kw["temperature"], beta=kw["beta"], eps_low=kw["epsilon_low"],
                eps_high=kw["epsilon_high"], loss_type=kw["loss_type"],
                max_completion_length=kw["max_completion_length"],
                importance_sampling_level=kw["importance_sampling_level"],
                sapo_temperature_pos=kw["sapo_temperature_pos"], sapo_temperature_neg=kw["sapo_temperature_neg"],
                delta=kw["delta"], use_bias_correction_kl=kw["use_bias_correction_kl"],
                vespo_k_pos=kw["vespo_k_pos"], vespo_lambda_pos=kw["vespo_lambda_pos"], vespo_k_neg=kw["vespo_k_neg"],
                vespo_lambda_neg=kw["vespo_lambda_neg"])


def _triton_call(fn, inputs, dtype, kw, reduce, inplace=False):
    x = inputs["logits"].detach().to(dtype).requires_grad_(True)
    out = fn(x * 1, inputs.get("old_logps"), inputs.get("ref_logps"), inputs["ids"], inputs["advantages"],
             inputs["mask"].long(), inplace=inplace, reduce=reduce, vllm_is_ratio=inputs.get("is_ratio"),
             num_items_in_batch=inputs.get("num_items_in_batch"), **kw)
    return out, x


def _per_token_definition(logps, inputs, kw):
    """Liger's per-token loss, KL and clip indicator from its definition, one token at a time (each token its
    own batch, reduced by bnpo, i.e. to itself): token-level configurations only."""
    B, T = logps.shape
    one = dict(kw, loss_type="bnpo" if LOSS_TABLE[kw["loss_type"]].policy == "clipped" else kw["loss_type"])
    loss, kl, clip = (torch.zeros(B, T, dtype=logps.dtype) for _ in range(3))
    rows = []
    for b in range(B):
        row = []
        for t in range(T):
            if not inputs["mask"][b, t]:
                row.append(logps[b, t] * 0)
                continue
            pick = {k: inputs[k][b:b + 1, t:t + 1].double() for k in ("old_logps", "ref_logps") if k in inputs}
            isr = inputs.get("is_ratio")
            isr = None if isr is None else (isr[b:b + 1, t:t + 1] if isr.dim() == 2 else isr[b:b + 1]).double()
            value, metrics = _liger_definition(logps[b:b + 1, t:t + 1], torch.ones(1, 1, dtype=torch.float64),
                                               inputs["advantages"][b:b + 1].double(), one, old=pick.get("old_logps"),
                                               ref=pick.get("ref_logps"), is_ratio=isr, num_items=1)
            row.append(value)
            if kw["beta"] != 0.0:
                kl[b, t] = metrics[0].detach()
            clip[b, t] = metrics[-1].detach()
        rows.append(torch.stack(row))
    return torch.stack(rows), kl, clip


def _definition(inputs, kw, lkw, reduce: bool, dtype, weights):
    """Liger's definition on the shifted logits in ``dtype`` (naive log-softmax): (outputs, d logits), outputs as
    ``triton_grpo_loss`` returns them (flattened; per-token KL 0 when beta == 0)."""
    x = inputs["logits"].to(dtype).requires_grad_(True)
    logps = _logps(x[:, :-1], inputs["ids"], kw["temperature"])
    if reduce:
        rest = {k: inputs[k].to(dtype) for k in ("old_logps", "ref_logps", "is_ratio") if k in inputs}
        loss, metrics = _liger_definition(logps, inputs["mask"].to(dtype), inputs["advantages"].to(dtype), lkw,
                                          old=rest.get("old_logps"), ref=rest.get("ref_logps"),
                                          is_ratio=rest.get("is_ratio"), num_items=inputs.get("num_items_in_batch"))
        return [loss] + list(metrics), torch.autograd.grad(loss, x)[0]
    loss, kl, clip = _per_token_definition(logps.double(), inputs, lkw)
    return [loss, kl, clip], torch.autograd.grad((loss * weights).sum(), x)[0]


def _flat(out, reduce):
    """``triton_grpo_loss``'s outputs as one list (a None KL as zeros)."""
    if reduce:
        return [out[0]] + list(out[1])
    return [out[0], torch.zeros_like(out[0]) if out[1] is None else out[1], out[2]]


def _check_triton_outputs(case, inputs, reduce, mine, grad, middle, truth):
    (middle, middle_grad), (truth, truth_grad) = middle, truth
    names = (["loss"] + (["kl"] if len(truth) == 3 else []) + ["clip"]) if reduce else ["loss", "kl", "clip"]
    assert len(mine) == len(truth) == len(middle)
    for name, a, b, t in zip(names, mine, middle, truth):
        if name != "clip" or clip_metric_agrees(case.config, inputs["mask"]):
            assert_three_way(a.detach(), b.detach(), t.detach(), torch.float32, f"{case.id}: {name}")
    assert_three_way(grad, middle_grad, truth_grad, torch.float32, f"{case.id}: d logits")
    assert (grad[:, -1] == 0).all()


def _skip_unless_token_local(case, reduce):
    if not reduce and not (case.config.importance_sampling_level == "token"
                           and LOSS_TABLE[case.config.loss_type].token_local):
        pytest.skip("the per-token definition is taken one token at a time: token-local configurations only")


@pytest.mark.parametrize("impl", ["auto", "triton"])
@pytest.mark.parametrize("reduce", [True, False], ids=["reduce", "per-token"])
@pytest.mark.parametrize("case", AGREE, ids=lambda c: c.id)
def test_triton_grpo_loss_matches_liger_definition(case, reduce, impl, monkeypatch, plans):
    """Loss (reduced or per token), metrics and d logits against Liger's definition in float64, within twice the
    error of the same definition on fp32 log-probs (naive fp32 log-softmax) plus fp32's atol."""
    _skip_unless_token_local(case, reduce)
    if impl == "triton":
        monkeypatch.setenv("GRPO_KERNELS_IMPL", "triton")
    inputs = _logits_inputs(case)
    T = inputs["ids"].shape[1]
    kw, lkw = _triton_kwargs(case.config, T), _liger_kwargs(case.config, T)
    weights = torch.rand(inputs["ids"].shape, generator=torch.Generator().manual_seed(1))
    out, x = _triton_call(ours.triton_grpo_loss, inputs, torch.float32, kw, reduce)
    if not reduce:
        assert (out[1] is None) == (kw["beta"] == 0.0)
    grad = torch.autograd.grad(out[0] if reduce else (out[0] * weights).sum(), x)[0]
    _check_triton_outputs(case, inputs, reduce, _flat(out, reduce), grad,
                          _definition(inputs, kw, lkw, reduce, torch.float32, weights),
                          _definition(inputs, kw, lkw, reduce, torch.float64, weights))
    assert plans and all(p.impl == ("torch" if impl == "auto" else "triton") for p in plans)


LIGER_TRITON = [c for c in AGREE if c.id in ("grpo-token", "dapo-token", "cispo-eps", "sapo-temps", "grpo-beta-kl",
                                             "is-ratio-token", "dapo-sequence", "delta", "num-items")]


@pytest.mark.interpreter
@pytest.mark.parametrize("reduce", [True, False], ids=["reduce", "per-token"])
@pytest.mark.parametrize("case", LIGER_TRITON, ids=lambda c: c.id)
def test_triton_grpo_loss_matches_liger_triton_kernel(case, reduce):
    """Liger's own Triton kernels (run by the interpreter) as the middle term: ours (Triton) is within twice their
    error against Liger's float64 definition."""
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss as liger_triton_grpo_loss

    _skip_unless_token_local(case, reduce)
    inputs = _logits_inputs(case)
    T = inputs["ids"].shape[1]
    kw, lkw = _triton_kwargs(case.config, T), _liger_kwargs(case.config, T)
    weights = torch.rand(inputs["ids"].shape, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (ours.triton_grpo_loss, liger_triton_grpo_loss):
        out, x = _triton_call(fn, inputs, torch.float32, kw, reduce)
        grad = torch.autograd.grad(out[0] if reduce else (out[0] * weights).sum(), x)[0]
        results.append((_flat(out, reduce), grad))
    _check_triton_outputs(case, inputs, reduce, *results[0], results[1],
                          _definition(inputs, kw, lkw, reduce, torch.float64, weights))


# ---------------------------------------------------------------------------------------- the drop-in contract

def _signature(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


OUR_KEYWORDS = [("batch_invariant", False, inspect.Parameter.KEYWORD_ONLY)]  # our one addition (docs/api.md)


def test_signatures_are_liger_s():
    """Every parameter, its default and its kind (positional order included) as in liger-kernel 0.8.5, followed by
    our keyword-only ``batch_invariant`` (off by default: a Liger call never meets it)."""
    from liger_kernel.ops.grpo_loss import fused_selective_log_softmax
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    theirs = liger_grpo.LigerFusedLinearGRPOLoss
    assert ours.LIGER_VERSION == "0.8.5"
    for mine, ref, added in ((ours.LigerFusedLinearGRPOLoss.__init__, theirs.__init__, OUR_KEYWORDS),
                             (ours.LigerFusedLinearGRPOLoss.forward, theirs.forward, []),
                             (ours.triton_grpo_loss, triton_grpo_loss, OUR_KEYWORDS),
                             (ours.fused_selective_log_softmax, fused_selective_log_softmax, OUR_KEYWORDS)):
        assert _signature(mine) == _signature(ref) + added, mine.__qualname__
    module = ours.LigerFusedLinearGRPOLoss()
    for name, default in list(inspect.signature(theirs.__init__).parameters.items())[1:]:
        assert getattr(module, name) == default.default, name  # attributes, as Liger stores them
    assert module.batch_invariant is False and module.config.batch_invariant is False
    assert module.config.beta == 0.04 and module.config.use_bias_correction_kl is False


@pytest.mark.parametrize("impl", ["auto", "triton"])
@pytest.mark.parametrize("reduce", [True, False], ids=["reduce", "per-token"])
def test_triton_grpo_loss_in_place_uses_the_logits_buffer(reduce, impl, monkeypatch):
    """inplace=True (Liger's default): the gradient of the (B, L + 1, V) logits is the logits buffer itself, holding
    d logits (0 at the last position), equal to the out-of-place gradient."""
    if impl == "triton":
        monkeypatch.setenv("GRPO_KERNELS_IMPL", "triton")
    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    inputs = _logits_inputs(case)
    kw = _triton_kwargs(case.config, inputs["ids"].shape[1])
    grads = []
    for inplace in (False, True):
        x = inputs["logits"].clone().requires_grad_(True)
        out = ours.triton_grpo_loss(x, inputs["old_logps"], inputs["ref_logps"], inputs["ids"], inputs["advantages"],
                                    inputs["mask"], inplace=inplace, reduce=reduce, **kw)
        (out[0] if reduce else out[0].sum()).backward()
        grads.append((x.grad, x.detach()))
    (expected, untouched), (grad, buffer) = grads
    assert torch.equal(untouched, inputs["logits"])
    assert grad.data_ptr() == buffer.data_ptr() and torch.equal(buffer, expected)
    assert (expected[:, -1] == 0).all() and expected.abs().sum() > 0


def test_use_ref_model_false_ignores_the_reference():
    """Liger's use_ref_model=False: the reference inputs are ignored, the KL term is 0 and so is the kl metric."""
    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    inputs = _head_inputs(case, "", torch.float32)
    args = (inputs["hidden"], inputs["weight"], inputs["ids"], inputs["mask"], inputs["advantages"], None,
            inputs["ref_logps"], inputs["old_logps"])
    loss, (kl, clip) = ours.LigerFusedLinearGRPOLoss(beta=0.04, use_ref_model=False, loss_type="grpo")(*args)
    plain, (clip0,) = ours.LigerFusedLinearGRPOLoss(beta=0.0, loss_type="grpo")(*args)
    assert kl.item() == 0.0 and torch.equal(loss, plain) and torch.equal(clip, clip0)


def test_reference_given_twice_warns_like_liger():
    """ref_per_token_logps and ref_input together: a warning, and ref_per_token_logps is used (Liger's rule), in the
    drop-in and in FusedLinearGRPOLoss alike."""
    import grpo_kernels as gk

    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    inputs = _head_inputs(case, "ref-input", torch.float32)
    ref = inputs["ref_input"] @ inputs["weight"].T  # any reference log-probs
    ref_logps = torch.log_softmax(ref, -1).gather(-1, inputs["ids"].unsqueeze(-1)).squeeze(-1)
    args = (inputs["hidden"], inputs["weight"], inputs["ids"], inputs["mask"].long(), inputs["advantages"], None,
            ref_logps, inputs["old_logps"], inputs["ref_input"], inputs["ref_weight"])
    for module in (ours.LigerFusedLinearGRPOLoss(loss_type="grpo"), liger_grpo.LigerFusedLinearGRPOLoss(
            loss_type="grpo", compiled=False), gk.FusedLinearGRPOLoss(loss_type="grpo", beta=0.04)):
        with pytest.warns(UserWarning, match="ref_input"):
            both, _ = module(*args)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            alone, _ = module(*args[:8])
        assert torch.equal(both, alone), type(module)


@pytest.mark.parametrize("call,match", [
    (lambda x, ids, a: ours.triton_grpo_loss(x[:, :-1], None, None, ids, a, beta=0.0), "completion_ids"),
    (lambda x, ids, a: ours.triton_grpo_loss(x[0], None, None, ids, a, beta=0.0), "logits"),
    (lambda x, ids, a: ours.triton_grpo_loss(x, None, None, ids, a), "ref_logps"),
    (lambda x, ids, a: ours.triton_grpo_loss(x, None, None, ids, a, beta=0.0, loss_type="ppo"), "loss_type"),
    (lambda x, ids, a: ours.LigerFusedLinearGRPOLoss(sapo_temperature_pos=0.0), "sapo_temperature_pos"),
    (lambda x, ids, a: ours.LigerFusedLinearGRPOLoss(delta=-1.0), "delta"),
    (lambda x, ids, a: ours.LigerFusedLinearGRPOLoss(importance_sampling_level="row"), "importance_sampling_level"),
], ids=["ids-length", "logits-2d", "beta-without-ref", "loss-type", "sapo-temperature", "delta", "level"])
def test_errors_name_the_argument(call, match):
    x = torch.randn(2, 4, 11)
    with pytest.raises(ValueError, match=match):
        call(x, torch.zeros(2, 3, dtype=torch.long), torch.ones(2))


# ------------------------------------------------------------------- where Liger's numbers are not TRL's: ours are

def _three_numbers(overrides, ref=False, full_mask=False, liger=True, old_shift=0.0):
    """(ours, Liger's definition, TRL 1.16's _compute_loss, TRL's in fp32) for one configuration on the same
    (B, L + 1, V) logits: ours (fp32) and Liger's (float64) as (loss, [kl,] clip), TRL's (float64, the truth; fp32,
    the middle term of the three-way rule for ours) as (loss, metrics dict)."""
    from tests.support.oracles import trl_compute_loss

    case = Case("difference", overrides, ref=ref)
    inputs = _logits_inputs(case, B=6, T=8)  # rows of both advantage signs, one fully masked, ragged lengths
    if full_mask:
        inputs["mask"] = torch.ones_like(inputs["mask"])
    # rows with A > 0 get ratios above 1 + old_shift: the high clip region is reached
    inputs["old_logps"] = inputs["old_logps"] - old_shift * (inputs["advantages"] > 0).float()[:, None]
    T, cfg = inputs["ids"].shape[1], case.config
    kw, lkw = _triton_kwargs(cfg, T), _liger_kwargs(cfg, T)
    loss, metrics = _triton_call(ours.triton_grpo_loss, inputs, torch.float32, kw, reduce=True)[0]
    x = inputs["logits"][:, :-1].double()
    rest = {k: inputs[k].double() for k in ("old_logps", "ref_logps") if k in inputs}
    theirs = (None, []) if not liger else _liger_definition(
        _logps(x, inputs["ids"], cfg.temperature), inputs["mask"].double(), inputs["advantages"].double(), lkw,
        old=rest.get("old_logps"), ref=rest.get("ref_logps"))
    trl = trl_compute_loss(x, inputs["ids"], inputs["advantages"].double(), inputs["mask"], config=cfg, **rest)
    trl32 = trl_compute_loss(inputs["logits"][:, :-1].float(), inputs["ids"], inputs["advantages"].float(),
                             inputs["mask"], config=cfg, **{k: v.float() for k, v in rest.items()})
    return (loss.item(), [m.item() for m in metrics]), \
        (theirs[0] if theirs[0] is None else theirs[0].item(), [m.item() for m in theirs[1]]), \
        (trl[0].item(), trl[1]), (trl32[0].item(), trl32[1])


def _like_trl(mine, trl, trl32, what, metric=None):
    """Our loss (or ``metric``, ours at mine[1][0]) against TRL's float64 value by the three-way rule, TRL's fp32
    value the middle term."""
    if metric is None:
        assert_three_way(mine[0], trl32[0], trl[0], torch.float32, f"{what} loss")
    else:
        assert_three_way(mine[1][0], float(trl32[1][metric]), float(trl[1][metric]), torch.float32,
                         f"{what} {metric}")


def test_difference_luspo_normalizer():
    """luspo: Liger weights each token's loss by its row's length and divides by B * T, padded positions included
    (the chunked module adds their policy and KL terms too); TRL 1.16 sums each row's valid tokens, mean over rows.
    Without padding they agree."""
    overrides = {"loss_type": "luspo", "beta": 0.04}
    mine, theirs, trl, trl32 = _three_numbers(overrides, ref=True)
    _like_trl(mine, trl, trl32, "luspo")
    assert abs(mine[0] - theirs[0]) > 1e-3  # bound: not a tolerance: another normalizer, O(the loss) apart
    mine, theirs, trl, trl32 = _three_numbers(overrides, ref=True, full_mask=True)
    _like_trl(mine, trl, trl32, "luspo without padding")
    assert_same_maths(theirs[0], trl[0], torch.float64, "Liger's definition without padding")


@pytest.mark.parametrize("loss_type", ["sapo", "vespo"])
def test_difference_clip_metric_of_sapo_and_vespo(loss_type):
    """sapo / vespo: Liger reports a clip ratio of 0 (no clipping in their loss), TRL 1.16 none; the drop-in's slot
    holds the fraction of tokens outside the clip region, ``clip_ratio/region_mean`` of grpo_loss's dict."""
    mine, theirs, trl, trl32 = _three_numbers({"loss_type": loss_type})
    assert "clip_ratio/region_mean" not in trl[1] and theirs[1] == [0.0]
    _like_trl(mine, trl, trl32, loss_type)
    assert mine[1][0] > 0


def test_difference_clip_metric_with_delta():
    """delta <= 1 + epsilon_high: TRL (and ours) count the delta-clamped ratio in the clip metric, Liger the raw one."""
    mine, theirs, trl, trl32 = _three_numbers({"loss_type": "dapo", "delta": 1.1, "epsilon_high": 0.28},
                                              old_shift=0.5)
    _like_trl(mine, trl, trl32, "delta")
    assert_same_maths(theirs[0], trl[0], torch.float64, "Liger's definition")
    _like_trl(mine, trl, trl32, "delta", metric="clip_ratio/region_mean")
    assert theirs[1][0] > mine[1][0]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_clip_metrics_read_the_delta_clamped_ratio(impl):
    """TRL's clip metrics read coef_1 after the delta clamp: ratios e^0.5 with A > 0, delta = 1.1 < 1 + eps_high,
    give no high clipping, on the reference (PyTorch path) and in the Triton kernels alike."""
    import grpo_kernels as gk
    from tests.support.oracles import trl_compute_loss

    logits = torch.randn(2, 4, 9, generator=torch.Generator().manual_seed(0))
    ids, adv = torch.zeros(2, 4, dtype=torch.long), torch.tensor([1.0, 0.5])
    old = torch.log_softmax(logits, -1)[..., 0] - 0.5
    cfg = gk.GRPOLossConfig(loss_type="grpo", delta=1.1, epsilon_high=0.28)
    _, metrics = gk.grpo_loss(logits, ids, adv, old_logps=old, config=cfg, impl=impl)
    _, trl = trl_compute_loss(logits.double(), ids, adv.double(), old_logps=old.double(), config=cfg)
    assert metrics["clip_ratio/high_mean"].item() == trl["clip_ratio/high_mean"] == 0.0


def test_difference_clip_metric_at_sequence_level():
    """Sequence-level ratios: TRL averages the clip indicator over sequences, Liger over valid tokens."""
    mine, theirs, trl, trl32 = _three_numbers({"loss_type": "grpo", "importance_sampling_level": "sequence",
                                               "epsilon_low": 0.02, "epsilon_high": 0.02}, old_shift=0.5)
    _like_trl(mine, trl, trl32, "sequence level")
    assert_same_maths(theirs[0], trl[0], torch.float64, "Liger's definition")
    _like_trl(mine, trl, trl32, "sequence level", metric="clip_ratio/region_mean")
    # bound: not a tolerance: a fraction over tokens vs over sequences, O(1e-1) apart
    assert abs(theirs[1][0] - mine[1][0]) > 1e-3


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_difference_sequence_level_cispo_sapo(loss_type):
    """Liger refuses sequence-level cispo / sapo (ValueError); the drop-in computes TRL's definition, warning as
    grpo_kernels does for that configuration."""
    overrides = {"loss_type": loss_type, "importance_sampling_level": "sequence"}
    with pytest.raises(ValueError, match="Sequence-level importance sampling is not supported"):
        liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, use_ref_model=False, **overrides)(
            torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 3, dtype=torch.long),
            torch.ones(2, 3, dtype=torch.long), torch.ones(2))
    with pytest.warns(UserWarning, match="Liger-Kernel 0.8.5 refuses"):
        ours.LigerFusedLinearGRPOLoss(**overrides)
    mine, _, trl, trl32 = _three_numbers(overrides, liger=False)
    _like_trl(mine, trl, trl32, loss_type)


def test_difference_dr_grpo_without_max_completion_length():
    """Liger's module requires max_completion_length for dr_grpo; the drop-in defaults it to T, as grpo_kernels does."""
    case = next(c for c in CASES if c.id == "dr_grpo-token")
    inputs = _head_inputs(case, "", torch.float32)
    args = (inputs["hidden"], inputs["weight"], inputs["ids"], inputs["mask"], inputs["advantages"], None, None,
            inputs["old_logps"])
    T = inputs["ids"].shape[1]
    assert torch.equal(ours.LigerFusedLinearGRPOLoss(loss_type="dr_grpo", beta=0.0)(*args)[0],
                       ours.LigerFusedLinearGRPOLoss(loss_type="dr_grpo", beta=0.0, max_completion_length=T)(*args)[0])
    with pytest.raises(AssertionError, match="max_completion_length"):
        liger_grpo.LigerFusedLinearGRPOLoss(loss_type="dr_grpo", beta=0.0, compiled=False, use_ref_model=False)(*args)


def test_fused_selective_log_softmax():
    """Liger's no-grad helper: the last L tokens of input_ids scored by logits[:, :-1], 0 where the mask is 0."""
    g = torch.Generator().manual_seed(9)
    logits, input_ids = torch.randn(3, 5, 23, generator=g), torch.randint(0, 23, (3, 7), generator=g)
    mask = (torch.rand(3, 7, generator=g) > 0.3).long()
    expected = _logps(logits[:, :-1].double(), input_ids[:, 3:], 0.9) * mask[:, 3:]
    got = ours.fused_selective_log_softmax(logits.requires_grad_(True), input_ids, mask=mask)
    assert not got.requires_grad and got.dtype == torch.float32
    naive = _logps(logits.detach()[:, :-1], input_ids[:, 3:], 0.9) * mask[:, 3:]
    assert_three_way(got, naive, expected, torch.float32, "log-probs")
    assert (got[mask[:, 3:] == 0] == 0).all()


@pytest.mark.parametrize("num_items", [None, 40], ids=["all-reduced-count", "given"])
def test_data_parallel_normalizer_is_liger_s(num_items, monkeypatch):
    """Under torch.distributed (here: a 2-rank group simulated in-process, the other rank holding as many tokens),
    dapo divides the global token count by the world size, as Liger and TRL do: Liger's own module and definition
    see the same group."""
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: t.mul_(2))
    case = next(c for c in CASES if c.id == "dapo-token")
    inputs = _head_inputs(case, "", torch.float32)
    inputs["num_items_in_batch"] = num_items
    kw = _liger_kwargs(case.config, inputs["ids"].shape[1], use_ref_model=False)
    mine = _run_module(ours.LigerFusedLinearGRPOLoss(**kw), inputs, torch.float32)
    theirs = _run_module(liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, **kw), inputs, torch.float32)
    _compare(mine, theirs, _truth(inputs, kw, False), torch.float32, case.config, inputs["mask"], "data parallel")
    n = 2 * inputs["mask"].sum().item() if num_items is None else num_items
    single = ours.LigerFusedLinearGRPOLoss(**kw)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    alone = _run_module(single, dict(inputs, num_items_in_batch=n / 2), torch.float32)
    assert torch.equal(mine[0], alone[0])
