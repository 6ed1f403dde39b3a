"""The per-token GRPO terms as one @triton.jit function, shared by every Triton kernel that needs them (today the
per-token stage of ``token_loss_kernels``): the Triton counterpart of ``reference.loss_from_logps``'s token-local
part, checked against it by the tests of every kernel that calls it.

Given a token's log-prob under the policy and the per-token inputs, ``token_terms`` returns the per-token loss
``l`` (policy term, times ``is_ratio``, plus ``beta`` times the k3 KL), its derivative ``d l / d logp``, the KL, the
ratio ``rho`` and the (delta-clamped) ratio the clip metrics use. ``KIND`` is the policy term's index in
``loss_types.POLICY_TERMS`` (0 clipped, 1 cispo, 2 sapo; vespo is not token-local). Works on scalars and blocks.
"""
from __future__ import annotations

from .._triton import import_triton

triton, tl = import_triton()


@triton.jit
def token_terms(logp, old, ref, adv, isr, eps_low, eps_high, delta, beta, sapo_t_pos, sapo_t_neg,
                KIND: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_IS: tl.constexpr,
                HAS_DELTA: tl.constexpr, USE_BETA: tl.constexpr, BIAS_CORRECTION: tl.constexpr):
    """(loss, d loss / d logp, kl, rho, clipped-metric ratio) of one token (or a block of tokens).

    old / ref / isr are ignored when their HAS_* flag is off (pass logp). Conventions of torch autograd: clamp
    passes the gradient on its closed interval, min splits it evenly between tied operands.
    """
    # Why PropagateNan.ALL: min / max default to the IEEE minNum / maxNum that drop a NaN operand, so a NaN
    # log-prob at a valid token would leave a finite clipped loss (torch's min / clamp propagate it).
    if HAS_OLD:
        log_ratio = logp - old
    else:
        log_ratio = logp * 0.0  # on-policy: ratio 1, d ratio / d logp = 1
    rho = tl.exp(log_ratio)

    # Policy term and d term / d rho, with torch's conventions: clamp passes gradient on its closed
    # interval, min splits it evenly between tied operands.
    if KIND == 0:
        lo = 1.0 - eps_low
        hi = 1.0 + eps_high
        coef2 = tl.minimum(tl.maximum(rho, lo, propagate_nan=tl.PropagateNan.ALL), hi,
                           propagate_nan=tl.PropagateNan.ALL)
        dcoef2 = tl.where((rho >= lo) & (rho <= hi), 1.0, 0.0)
        if HAS_DELTA:
            rho1 = tl.minimum(rho, delta, propagate_nan=tl.PropagateNan.ALL)
            drho1 = tl.where(rho <= delta, 1.0, 0.0)
        else:
            rho1 = rho
            drho1 = rho * 0.0 + 1.0
        a = rho1 * adv
        c = coef2 * adv
        policy = -tl.minimum(a, c, propagate_nan=tl.PropagateNan.ALL)
        d_rho = -adv * tl.where(a < c, drho1, tl.where(a > c, dcoef2, 0.5 * (drho1 + dcoef2)))
        d_policy = d_rho * rho
    elif KIND == 1:
        # cispo: -stopgrad(min(rho, eps_high)) * A * logp
        rho1 = rho
        clamped = tl.minimum(rho, eps_high, propagate_nan=tl.PropagateNan.ALL)
        policy = -clamped * adv * logp
        d_policy = -clamped * adv
    else:
        # sapo: -sigmoid(t (rho - 1)) * 4 / t * A
        rho1 = rho
        temp = tl.where(adv > 0, sapo_t_pos, sapo_t_neg)
        gate = tl.sigmoid(temp * (rho - 1.0))
        policy = -gate * 4.0 / temp * adv
        d_policy = -4.0 * adv * gate * (1.0 - gate) * rho
    if HAS_IS:
        policy = policy * isr
        d_policy = d_policy * isr

    # k3 KL to the reference: exp(ref - logp) - (ref - logp) - 1, optionally times the ratio.
    kl = logp * 0.0
    if HAS_REF:
        diff = ref - logp
        kl = tl.exp(diff) - diff - 1.0
        d_kl = 1.0 - tl.exp(diff)
        if BIAS_CORRECTION:
            d_kl = d_kl * rho + kl * rho
            kl = kl * rho
        if USE_BETA:
            policy = policy + beta * kl
            d_policy = d_policy + beta * d_kl
    return policy, d_policy, kl, rho, rho1


@triton.jit
def token_terms_at(logp, old_ptr, ref_ptr, isr_ptr, tok, isr_offset, adv, eps_low, eps_high, delta, beta,
                   sapo_t_pos, sapo_t_neg, KIND: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr,
                   HAS_IS: tl.constexpr, HAS_DELTA: tl.constexpr, USE_BETA: tl.constexpr,
                   BIAS_CORRECTION: tl.constexpr):
    """``token_terms`` of one token whose optional inputs are read where present: old / ref log-probs at ``tok``,
    is_ratio at ``isr_offset``. Used by the row kernels that form the gradient in the forward."""
    old = logp
    ref = logp
    isr = logp
    if HAS_OLD:
        old = tl.load(old_ptr + tok)
    if HAS_REF:
        ref = tl.load(ref_ptr + tok)
    if HAS_IS:
        isr = tl.load(isr_ptr + isr_offset)
    return token_terms(logp, old, ref, adv, isr, eps_low, eps_high, delta, beta, sapo_t_pos, sapo_t_neg, KIND,
                       HAS_OLD, HAS_REF, HAS_IS, HAS_DELTA, USE_BETA, BIAS_CORRECTION)
