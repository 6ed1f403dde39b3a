"""torch.compile: a training step calling ``grpo_loss`` and ``fused_linear_grpo_loss`` compiles with
``fullgraph=True`` (no graph break), gives eager's loss, gradients and metrics, and a varying completion length T
does not recompile every step; the registered ops (``grpo_kernels/ops.py``) pass ``torch.library.opcheck``.

On CPU the torch impl runs, and the Triton impl under TRITON_INTERPRET=1 (tests/conftest.py); on CUDA (the GPU
check, benchmarks/gpu_check.sh) ``test_compiled_step_on_cuda`` runs the Triton kernels through inductor.
"""
from __future__ import annotations

import pytest
import torch

from grpo_kernels import GRPOLossConfig, fused_linear_grpo_loss, grpo_loss, linear_token_logprobs, token_logprobs

from ..support.compiling import CountingBackend
from ..support.tolerances import assert_three_way, grad_scale

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # each test counts its own compiles

# torch.compile of every entry point is ~3-6 min of compilation on a CPU: one case of each test runs in the fast
# suite (README's test command), the other cases under -m slow (CI's second step); dynamic float options:
# tests/api/test_compile_dynamic.py
SLOW = pytest.mark.slow


def _cases(names, values, fast):
    """pytest params of every (name, value) pair, all but ``fast`` marked slow."""
    return [pytest.param(n, v, id=f"{n}-{v}", marks=[] if (n, v) == fast else [SLOW]) for n in names for v in values]

B, V, H = 2, 64, 16
CONFIGS = {
    # token-level: logits.fast / head.fast on Triton
    "dapo_kl_entropy": GRPOLossConfig(beta=0.04, entropy_coef=0.01),
    # sequence-level ratio: logits.sweep + reference stage; head.light under compile
    "gspo": GRPOLossConfig(importance_sampling_level="sequence"),
    # separate sweeps: logits.sweep / head.light + the Triton per-token stage
    "grpo_two_sweeps": GRPOLossConfig(loss_type="grpo", grad_in_forward=False),
    # a soft-capped head (Gemma 2) at a sampling temperature: the cap travels through every op as a scalar
    "softcap": GRPOLossConfig(beta=0.04, softcap=2.0, temperature=0.9),
}


def _batch(T: int, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(T)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T)
    mask[0, T - 3:] = 0  # padding: the compiled ops compact the valid rows at run time, as eager does
    old = torch.randn(B, T, generator=g) * 0.1 - 4.0
    ref = old + 0.05
    out = [hidden.to(dtype), weight.to(dtype), ids, adv, mask, old, ref]
    return [t.to(device) for t in out]


def _step_fn(cfg, impl):
    def step(hidden, weight, ids, adv, mask, old, ref):
        logits = hidden @ weight.T
        l1, m1 = grpo_loss(logits, ids, adv, mask, old_logps=old, ref_logps=ref, config=cfg, impl=impl)
        l2, m2 = fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old_logps=old, ref_logps=ref, config=cfg,
                                        impl=impl)
        return l1 + 2 * l2, m1, m2

    return step


def _run(fn, args, dynamic_T: bool = False):
    hidden = args[0].clone().requires_grad_(True)
    weight = args[1].clone().requires_grad_(True)
    if dynamic_T:  # every (B, T, ...) input has T at dim 1
        for t in (hidden, *args[2:]):
            if t.dim() == 2 or t is hidden:
                torch._dynamo.mark_dynamic(t, 1)
    loss, m1, m2 = fn(hidden, weight, *args[2:])
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, m1, m2


def _assert_same(eager, compiled):
    """Bitwise: aot_eager runs the registered ops' own code on the same inputs, generating none, and the call takes
    the path eager takes, so the same operations in the same order give the same bits."""
    for a, b, what in zip(eager[:3], compiled[:3], ("loss", "d hidden", "d weight")):
        assert torch.equal(b, a), f"{what}: compiled differs from eager by {(b - a).abs().max().item():.3e}"
    for ma, mb in zip(eager[3:], compiled[3:]):
        assert ma.keys() == mb.keys()
        for k in ma:
            assert torch.equal(mb[k], ma[k]), f"metric {k}"


def _truth(fn, args):
    """``fn`` (built for the torch impl) on float64 copies of ``args``, on the CPU: the ground truth."""
    return _run(fn, [t.detach().cpu().double() if t.is_floating_point() else t.cpu() for t in args])


def _assert_close_by_three_way(eager, compiled, truth, dtype):
    """Where the compiled call may take another path or generate code (inductor): the three-way rule, eager in the
    same dtype as the middle term (compiling may not add more than K times eager's own rounding error)."""
    for a, b, t, what in zip(eager[:3], compiled[:3], truth[:3], ("loss", "d hidden", "d weight")):
        scale = grad_scale(t) if what != "loss" else None
        assert_three_way(b.cpu(), a.cpu(), t, dtype, f"compiled {what}", scale=scale)
    for ma, mb, mt in zip(eager[3:], compiled[3:], truth[3:]):
        assert ma.keys() == mb.keys()
        for k in ma:
            assert_three_way(mb[k].cpu(), ma[k].cpu(), mt[k], dtype, f"compiled metric {k}")


@pytest.mark.parametrize("name, impl", _cases(list(CONFIGS), ["torch", "triton"], fast=("gspo", "torch")))
def test_compiled_step_matches_eager_and_varying_T_compiles_at_most_twice(name, impl):
    backend = CountingBackend()
    step = _step_fn(CONFIGS[name], impl)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    truth_step = _step_fn(CONFIGS[name], "torch")
    for T in (8, 13, 21):
        args = _batch(T)
        # eager and compiled may take different paths here (head.fast_sequence vs head.light for gspo)
        _assert_close_by_three_way(_run(step, args), _run(compiled, args), _truth(truth_step, args), torch.float32)
    # the first T compiles a static graph, the second marks T dynamic; no later T recompiles
    assert backend.graphs <= 2, f"{backend.graphs} compiles for 3 values of T"


def test_mark_dynamic_compiles_once():
    backend = CountingBackend()
    step = _step_fn(CONFIGS["dapo_kl_entropy"], "torch")
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for T in (8, 12, 16):
        args = _batch(T)
        _assert_close_by_three_way(_run(step, args), _run(compiled, args, dynamic_T=True), _truth(step, args),
                                   torch.float32)
    assert backend.graphs == 1


def test_inductor_compiles_the_torch_impl():
    """The default backend (inductor: generated C++ on CPU) around the registered ops."""
    step = _step_fn(CONFIGS["dapo_kl_entropy"], "torch")
    compiled = torch.compile(step, fullgraph=True)
    args = _batch(8)
    _assert_close_by_three_way(_run(step, args), _run(compiled, args), _truth(step, args), torch.float32)


@pytest.mark.parametrize("impl, softcap", _cases(["torch", "triton"], [None, 2.0], fast=("torch", 2.0)))
def test_logprob_functions_compile(impl, softcap):
    """token_logprobs and linear_token_logprobs (with a mask: padded rows are 0 and get no gradient) compile and
    match eager, values and gradients through both outputs, with and without a soft cap."""
    def fn(hidden, weight, ids, mask):
        logp, ent = token_logprobs(hidden @ weight.T, ids, temperature=0.7, return_entropy=True, impl=impl,
                                   softcap=softcap)
        lp2, ent2 = linear_token_logprobs(hidden, weight, ids, temperature=0.7, return_entropy=True, impl=impl,
                                          mask=mask, softcap=softcap)
        loss = (logp * 0.3 + ent * 0.1).sum() + (lp2 * 0.5 - ent2 * 0.2).sum()
        return loss, {"logp": lp2.detach(), "entropy": ent2.detach()}, {}

    backend = CountingBackend()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for T in (5, 9, 13):
        hidden, weight, ids, _, mask, _, _ = _batch(T)
        eager = _run(fn, (hidden, weight, ids, mask))
        assert torch.all(eager[3]["logp"][mask == 0] == 0)
        _assert_same(eager, _run(compiled, (hidden, weight, ids, mask)))
    assert backend.graphs <= 2


def test_a_chosen_invariant_block_compiles(plans):
    """linear_token_logprobs(batch_invariant=True, invariant_block_rows=8) on the Triton head (head.light, whose
    layout the compiled op picks when it runs): the compiled call's log-probs and d hidden are bitwise eager's, and
    the compiled plan keeps the 8-row block."""
    hidden, weight, ids, _, _, _, _ = _batch(13)

    def fn(h):
        return linear_token_logprobs(h, weight, ids, impl="triton", batch_invariant=True, invariant_block_rows=8)

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        h = hidden.clone().requires_grad_(True)
        logp = f(h)
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        results.append((logp.detach(), h.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert {(p.path, p.chunk_rows) for p in plans} == {("head.light", 8)}


def test_modules_compile():
    """GRPOLoss and FusedLinearGRPOLoss (Liger's argument order, reference log-probs from ref_input / ref_weight)."""
    import grpo_kernels as gk

    plain, fused = gk.GRPOLoss(), gk.FusedLinearGRPOLoss(beta=0.04)

    def fn(hidden, weight, ids, adv, mask, old, ref):
        a, m1 = plain(hidden @ weight.T, ids, adv, mask, old_logps=old)
        b, m2 = fused(hidden, weight, ids, mask, adv, ref_input=hidden.detach(), ref_weight=weight.detach() + 0.01)
        return a + b, m1, m2

    args = _batch(8)
    _assert_same(_run(fn, args), _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), args))


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=SLOW)])
def test_autocast_and_keyword_overrides_compile(impl):
    """Under torch.autocast (bf16 head, fp32 master weights; head.fast on Triton) with loss options given as keyword
    overrides inside the compiled step."""
    def fn(hidden, weight, ids, adv, mask, old, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, metrics = fused_linear_grpo_loss(hidden, weight, ids, adv, mask, impl=impl, entropy_coef=0.01)
            logp = linear_token_logprobs(hidden, weight, ids, impl=impl, mask=mask)
        return loss + 0.01 * logp.sum(), metrics, {}

    args = _batch(8)
    eager, compiled = _run(fn, args), _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), args)
    assert compiled[2].dtype == torch.float32
    _assert_same(eager, compiled)


def test_no_grad_logprobs_compile():
    """The old / reference-policy pass: linear_token_logprobs under torch.no_grad (head.no_grad on Triton)."""
    impl = "triton"

    @torch.no_grad()
    def fn(hidden, weight, ids):
        return linear_token_logprobs(hidden, weight, ids, impl=impl)

    hidden, weight, ids, *_ = _batch(7)
    # the same op on the same inputs, no code generated (aot_eager): the same bits
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="aot_eager")(hidden, weight, ids),
                       fn(hidden, weight, ids))


@pytest.mark.parametrize("option", ["inplace_backward", "process_group", "gather_head"])
def test_options_without_compiled_form_are_refused(option):
    hidden, weight, ids, adv, mask, old, ref = _batch(8)
    kwargs = {"process_group": object()} if option == "process_group" else {"gather_head": _no_gather}

    def fn(hidden, weight):
        if option == "inplace_backward":
            return grpo_loss(hidden @ weight.T, ids, adv, mask, inplace_backward=True)[0]
        return fused_linear_grpo_loss(hidden, weight, ids, adv, mask, **kwargs)[0]

    with pytest.raises(Exception, match=f"{option}.*not supported under torch.compile"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(hidden.requires_grad_(), weight)


def _no_gather():
    import contextlib
    return contextlib.nullcontext()


def test_eager_checks_are_kept():
    """The host-sync checks skipped while compiling still run in eager."""
    hidden, weight, ids, adv, mask, old, ref = _batch(8)
    with pytest.raises(ValueError, match="ids must lie in"):
        fused_linear_grpo_loss(hidden, weight, ids + V, adv, mask)
    with pytest.raises(ValueError, match="is_ratio must be >= 0"):
        grpo_loss(hidden @ weight.T, ids, adv, mask, is_ratio=-torch.ones(B))


def _opcheck(name, args, kwargs=None):
    torch.library.opcheck(getattr(torch.ops.grpo_kernels, name).default, args, kwargs)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=SLOW)])
def test_ops_pass_opcheck(impl):
    """Schema, fake kernels and autograd registrations of the registered ops (torch.library.opcheck): the torch
    impl's ops, and the Triton ones under the interpreter (on CUDA: test_compiled_step_on_cuda). Every op takes its
    non-tensor options as the encoded pair (``ops.encode``: a float64 tensor and a list of ints)."""
    from grpo_kernels import ops  # registered on import of grpo_kernels
    from grpo_kernels.config import LogitTransform
    from grpo_kernels.head.fast import FastOptions
    from grpo_kernels.head.light import LightOptions
    from grpo_kernels.inputs import HeadTokens, LossTokens
    from grpo_kernels.logits.fast import LossOptions
    from grpo_kernels.logits.logprobs import SweepOptions

    T = 6
    hidden, weight, ids, adv, mask, old, ref = _batch(T)
    logits = (hidden @ weight.T).requires_grad_(True)
    capped = LogitTransform(0.7, 3.0)
    h = hidden.reshape(-1, H).requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    if impl == "torch":
        _opcheck("logits_logprobs", (logits, ids, None, *ops.encode(SweepOptions(capped, "torch", 5))))
        bias = torch.randn(V, requires_grad=True)
        _opcheck("head_logprobs", (h, w, bias, ids.reshape(-1), mask.reshape(-1),
                                   *ops.encode(LightOptions("head.torch", capped, True, 4))))
        return
    cfg = GRPOLossConfig(beta=0.04, entropy_coef=0.01)
    weights = mask / mask.sum()
    logps = (torch.randn(B, T) - 4).requires_grad_(True)
    tokens = LossTokens(adv, mask, weights, old, ref, None).as_list()
    _opcheck("token_stage", (logps, tokens, *ops.encode(cfg)))
    _opcheck("logits_loss_fast", (logits, ids, tokens, mask.sum(), *ops.encode(LossOptions(cfg, cfg.transform))))
    _opcheck("head_logprobs", (h, w, None, ids.reshape(-1), mask.reshape(-1),
                               *ops.encode(LightOptions("head.light", LogitTransform(0.7), True, working_bytes=1 << 20))))

    def flat(x):
        return x.reshape(-1).float().contiguous()

    n_valid = float(mask.sum())
    head_tokens = HeadTokens(adv.repeat_interleave(T), flat(weights), flat(old), flat(ref), None,
                             torch.tensor([-0.01 / n_valid]))
    _opcheck("head_loss_fast", (h, w, None, ids.reshape(-1), mask.reshape(-1), head_tokens.as_list(),
                                torch.tensor(1 / n_valid, dtype=torch.float64), [True, True, False],
                                *ops.encode(FastOptions(torch.float32, cfg, cfg.transform, 16))))


def test_options_cross_the_op_boundary_unchanged():
    """``ops.encode`` / ``ops.decode`` give back every option object the ops take, field for field (None, str
    choices, dtypes, nested objects)."""
    from grpo_kernels import ops
    from grpo_kernels.config import LogitTransform
    from grpo_kernels.head.fast import FastOptions
    from grpo_kernels.head.light import LightOptions

    cfg = GRPOLossConfig(loss_type="sapo", beta=0.04, delta=1.5, importance_sampling_level="sequence",
                         max_completion_length=77, memory_budget=(1 << 40) + 3, softcap=30.0, deterministic=False,
                         round_logits="bf16")
    for obj in (cfg, GRPOLossConfig(), GRPOLossConfig(batch_invariant=True, invariant_block_rows=64), LightOptions("head.no_grad", LogitTransform(0.25, None), False, 7, 8, 9, 10),
                FastOptions(torch.bfloat16, cfg, LogitTransform(0.9, 20.0, "fp16"), 256)):
        assert ops.decode(type(obj), *ops.encode(obj)) == obj
    floats, ints = ops.encode(cfg)
    assert floats.dtype == torch.float64 and floats.device.type == "cpu"  # read by the op with no device sync
    # a fake kernel's decode: every option but the floats, which take their defaults
    defaults = GRPOLossConfig()
    assert ops.decode_for_fake(GRPOLossConfig, ints) == cfg.replace(
        **{name: getattr(defaults, name) for name in ("beta", "delta", "softcap")})
    with pytest.raises(ValueError, match="option values"):
        ops.decode(LogitTransform, [1.0, float("nan"), 2.0], [])


_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton kernels compiled for "
                                 "the GPU run in the GPU check (benchmarks/gpu_check.sh)")


# The CUDA cases stay under -m slow (as the whole file was): the GPU check's time limit (benchmarks/gpu_check.sh)
@SLOW
@_NEEDS_CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_step_on_cuda(name, dtype):
    """Inductor for bf16 (generated Triton code around the ops); aot_eager for fp32 (the ops' fake kernels and
    autograd on CUDA tensors, without a second code generation: the GPU check's time limit)."""
    backend = CountingBackend("inductor" if dtype == torch.bfloat16 else "aot_eager")
    step = _step_fn(CONFIGS[name], "auto")
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    # eager and compiled may take different head paths (head.fast_sequence vs head.light for gspo), and inductor
    # generates code: the three-way rule against float64 on the CPU, eager on the GPU in the same dtype the middle term
    truth_step = _step_fn(CONFIGS[name], "torch")
    for T in (8, 12, 21):
        args = _batch(T, "cuda", dtype)
        _assert_close_by_three_way(_run(step, args), _run(compiled, args), _truth(truth_step, args), dtype)
    assert backend.graphs <= 2


@SLOW
@_NEEDS_CUDA
def test_logprob_functions_compile_on_cuda():
    """token_logprobs (logits.sweep), linear_token_logprobs with gradients (head.light, the layout picked when the
    op runs) and under no_grad (head.no_grad)."""
    def fn(hidden, weight, ids, mask):
        logp, ent = token_logprobs(hidden @ weight.T, ids, return_entropy=True)
        lp2, ent2 = linear_token_logprobs(hidden, weight, ids, return_entropy=True, mask=mask)
        with torch.no_grad():
            lp3 = linear_token_logprobs(hidden, weight, ids)
        loss = (logp * 0.3 + ent * 0.1).sum() + (lp2 * 0.5 - ent2 * 0.2).sum()
        return loss, {"logp": lp2.detach(), "no_grad": lp3}, {}

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    hidden, weight, ids, _, mask, _, _ = _batch(9, "cuda")
    # the layout is picked when the op runs and may differ from eager's: the three-way rule against float64 (CPU)
    args = (hidden, weight, ids, mask)
    _assert_close_by_three_way(_run(fn, args), _run(compiled, args), _truth(fn, args), torch.float32)
