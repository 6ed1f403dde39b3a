"""``grpo_kernels.liger``: Liger-Kernel 0.8.5's GRPO entry points on grpo_kernels (issue 30).

Checked against Liger's own code, installed (the test extra): the constructor / forward / function signatures
are Liger's, parameter for parameter; the numbers are compared with Liger's torch definition
(``LigerFusedLinearGRPOFunction.ppo_loss_fn``) evaluated in float64 as ground truth, with Liger's own chunked
module (``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss``) in the same dtype as the middle term of the
three-way rule (tests/tolerances.py), on the cases where Liger's definitions and TRL's agree. Where they do not,
a test pins each documented difference (docs/api.md, "Coming from Liger-Kernel") and that ours is TRL's.
"""
import inspect
import warnings

import pytest
import torch

from tests.cases import CASES, Case, make_inputs
from tests.tolerances import assert_three_way

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
                eps_high=kw["epsilon_high"], loss_type=kw["loss_type"], max_completion_length=kw["max_completion_length"],
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


@pytest.mark.parametrize("impl", ["auto", "triton"])
@pytest.mark.parametrize("reduce", [True, False], ids=["reduce", "per-token"])
@pytest.mark.parametrize("case", AGREE, ids=lambda c: c.id)
def test_triton_grpo_loss_matches_liger_definition(case, reduce, impl, monkeypatch, plans):
    """Loss (reduced or per token), metrics and d logits against Liger's definition in float64, within twice the
    error of the same definition on fp32 log-probs (naive fp32 log-softmax) plus fp32's atol."""
    if not reduce and not (case.config.importance_sampling_level == "token" and LOSS_TABLE[case.config.loss_type]
                           .token_local):
        pytest.skip("the per-token definition is taken one token at a time: token-local configurations only")
    if impl == "triton":
        monkeypatch.setenv("GRPO_KERNELS_IMPL", "triton")
    inputs = _logits_inputs(case)
    T = inputs["ids"].shape[1]
    kw = _triton_kwargs(case.config, T)
    lkw = _liger_kwargs(case.config, T)
    weights = torch.rand(inputs["ids"].shape, generator=torch.Generator().manual_seed(1))

    def definition(dtype):
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

    truth, truth_grad = definition(torch.float64)
    middle, middle_grad = definition(torch.float32)
    out, x = _triton_call(ours.triton_grpo_loss, inputs, torch.float32, kw, reduce)
    mine = [out[0]] + list(out[1]) if reduce else list(out)
    if not reduce and kw["beta"] == 0.0:
        assert mine[1] is None
        mine[1] = torch.zeros_like(mine[0])
    grad = torch.autograd.grad(out[0] if reduce else (out[0] * weights).sum(), x)[0]
    names = ["loss"] + (["kl"] if len(mine) == 3 else []) + ["clip"] if reduce else ["loss", "kl", "clip"]
    for name, a, b, t in zip(names, mine, middle, truth):
        if name != "clip" or clip_metric_agrees(case.config, inputs["mask"]):
            assert_three_way(a.detach(), b.detach(), t.detach(), torch.float32, f"{case.id}: {name}")
    assert_three_way(grad, middle_grad, truth_grad, torch.float32, f"{case.id}: d logits")
    assert (grad[:, -1] == 0).all()
    assert plans and all(p.impl == ("torch" if impl == "auto" else "triton") for p in plans)
