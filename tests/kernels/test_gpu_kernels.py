"""Compiled Triton kernels on a CUDA GPU (skipped elsewhere; `benchmarks/gpu_check.sh` runs this file first).

On CPU the same kernels are covered under TRITON_INTERPRET=1 by the other test files; here they run compiled, at
sizes the interpreter cannot reach (V = 151936, B*T*V > 2^31), against the eager reference on the same GPU.
"""
import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.reference import logprobs_and_entropy, reference_grpo_loss

from ..support.cases import CASES, make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU; runs in benchmarks/gpu_check.sh")]
DEV = "cuda"


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_path_at_qwen_vocab(dtype):
    """B*T = 2048 tokens, V = 151936: log-prob, entropy and d logits against the fp64 reference on the GPU."""
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = (torch.randn(2, 1024, 151936, device=DEV, generator=g) * 2).to(dtype)
    ids = torch.randint(0, 151936, (2, 1024), device=DEV, generator=g)
    a = torch.randn(2, 1024, device=DEV, generator=g)
    x = logits.clone().requires_grad_(True)
    logp, ent = gk.token_logprobs(x, ids, 0.9, return_entropy=True, impl="triton")
    (grad,) = torch.autograd.grad((a * logp + a * ent).sum(), x)
    rows = slice(0, 64)  # float64 ground truth on a slice keeps the check within memory
    x64 = logits[:, rows].double().requires_grad_(True)
    t_logp, t_ent = logprobs_and_entropy(x64, ids[:, rows], 0.9)
    (t_grad,) = torch.autograd.grad((a[:, rows] * t_logp + a[:, rows] * t_ent).sum(), x64)
    assert (logp[:, rows].double() - t_logp).abs().max().item() < 2e-4
    assert (ent[:, rows].double() - t_ent).abs().max().item() < 2e-4
    assert _rel(grad[:, rows], t_grad) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_int64_offsets_beyond_2_to_the_31():
    """16384 x 151936 bf16 logits (2.5e9 elements): the last rows are right (int32 offsets would wrap)."""
    logits = torch.randn(1, 16384, 151936, device=DEV, dtype=torch.bfloat16)
    ids = torch.randint(0, 151936, (1, 16384), device=DEV)
    with torch.no_grad():
        logp = gk.token_logprobs(logits, ids, impl="triton")
        t_logp, _ = logprobs_and_entropy(logits[:, -8:].float(), ids[:, -8:])
    assert (logp[:, -8:] - t_logp).abs().max().item() < 1e-4


@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["grad-in-forward", "separate"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_grpo_loss_matches_reference_on_gpu(case, grad_in_forward):
    inputs = {k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in make_inputs(case, V=5000).items()}
    logits = inputs.pop("logits")
    args = (inputs.pop("ids"), inputs.pop("advantages"), inputs.pop("mask"))
    x = logits.clone().requires_grad_(True)
    loss, _ = gk.grpo_loss(x, *args, config=case.config.replace(grad_in_forward=grad_in_forward), impl="triton",
                           **inputs)
    (grad,) = torch.autograd.grad(loss, x)
    y = logits.double().requires_grad_(True)
    t_loss, _ = reference_grpo_loss(y, *args, config=case.config, **inputs)
    (t_grad,) = torch.autograd.grad(t_loss, y)
    assert abs(loss.item() - t_loss.item()) <= 1e-5 * max(abs(t_loss.item()), 1e-6)
    assert _rel(grad, t_grad) <= 1e-5


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_linear_loss_on_gpu(dtype, deterministic):
    """N = 2048, H = 1024, V = 32000: loss and gradients against fp64 full logits; deterministic mode is
    bitwise reproducible."""
    case = next(c for c in CASES if c.id == "everything")
    inputs = {k: (v.to(DEV) if torch.is_tensor(v) else v)
              for k, v in make_inputs(case, B=4, T=512, V=32000, hidden_size=1024, dtype=dtype).items()}
    hidden, weight = inputs.pop("hidden"), inputs.pop("weight")
    args = (inputs.pop("ids"), inputs.pop("advantages"), inputs.pop("mask"))

    def run():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, _ = gk.fused_linear_grpo_loss(h, w, *args, config=case.config, impl="triton",
                                            deterministic=deterministic, **inputs)
        return (loss.detach(), *torch.autograd.grad(loss, (h, w)))
    ours = run()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    t_loss, _ = reference_grpo_loss(h64 @ w64.T, *args, config=case.config, **inputs)
    truth = (t_loss.detach(), *torch.autograd.grad(t_loss, (h64, w64)))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, o, t in zip(("loss", "d hidden", "d weight"), ours, truth):
        assert _rel(o, t) <= tol, name
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(ours, run()))


def test_new_lengths_and_temperature_do_not_recompile():
    from grpo_kernels.kernels.logits_kernels import logits_logprobs_fwd as fwd
    caches = getattr(fwd, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton version exposes no JIT cache to inspect")

    def call(T, tau):
        logits = torch.randn(2, T, 1024, device=DEV)  # V % 16 == 0: the row stride keeps its alignment class
        gk.token_logprobs(logits, torch.zeros(2, T, dtype=torch.long, device=DEV), tau, impl="triton")
    call(2, 1.0)  # compiles the fp32 variant once
    before = sum(len(entry[0]) for entry in caches.values())
    for T, tau in ((3, 1.0), (5, 0.7), (17, 1.3), (1, 0.5)):
        call(T, tau)
    after = sum(len(entry[0]) for entry in caches.values())
    assert after == before, f"{after - before} new variants compiled for new lengths / temperatures"


def _qwen_batch(B, T, V, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = (torch.randn(B, T, V, device=DEV, generator=g) * 2).to(dtype)
    ids = torch.randint(0, V, (B, T), device=DEV, generator=g)
    mask = torch.arange(T, device=DEV) < torch.tensor([T, T // 3], device=DEV)[:B].unsqueeze(1)
    logp = torch.randn(B, T, device=DEV, generator=g) * 0.1 - 3
    return logits, ids, mask, {"advantages": torch.tensor([1.0, -0.5], device=DEV)[:B], "old_logps": logp,
                               "ref_logps": logp - 0.1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grad_in_forward_at_qwen_vocab(dtype):
    """B=2, T=1024, V=151936, dapo with KL and an entropy bonus, a third of row 2 valid: the grad-in-forward kernel
    (new buffer and in place) against the separate sweeps and the fp64 reference on a slice of rows."""
    logits, ids, mask, rest = _qwen_batch(2, 1024, 151936, dtype)
    cfg = gk.GRPOLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01, temperature=0.9)
    results = {}
    for name, gif, inplace in (("gif", True, False), ("gif-inplace", True, True), ("separate", False, False)):
        x = logits.clone().requires_grad_(True)
        loss, metrics = gk.grpo_loss(x, ids, rest["advantages"], mask, config=cfg.replace(grad_in_forward=gif),
                                     impl="triton", inplace_backward=inplace, old_logps=rest["old_logps"],
                                     ref_logps=rest["ref_logps"])
        (loss * 3.0).backward()
        results[name] = (loss.detach(), x.grad, metrics)
        if inplace:
            assert x.grad.data_ptr() == x.data_ptr()
    assert torch.equal(results["gif"][1], results["gif-inplace"][1])
    assert _rel(results["gif"][1], results["separate"][1]) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert abs(results["gif"][0].item() - results["separate"][0].item()) <= 1e-5 * abs(results["separate"][0].item())
    assert (results["gif"][1][1, 1024 // 3:] == 0).all(), "padded tokens must get zero gradient"
    t_loss, _ = reference_grpo_loss(logits.double(), ids, rest["advantages"], mask, config=cfg,
                                    old_logps=rest["old_logps"], ref_logps=rest["ref_logps"])
    assert abs(results["gif"][0].item() - t_loss.item()) <= 1e-4 * abs(t_loss.item())


def test_grad_in_forward_long_row():
    """B=1, T=131072, V=32768 bf16 (a 1-D grid; T >= 65536 breaks a 2-D one): finite loss and gradient, equal to
    the separate sweeps."""
    logits, ids, mask, rest = _qwen_batch(1, 131072, 32768, torch.bfloat16, seed=1)
    grads = []
    for gif in (True, False):
        x = logits.clone().requires_grad_(True)
        loss, _ = gk.grpo_loss(x, ids, rest["advantages"], mask, loss_type="grpo", grad_in_forward=gif,
                               impl="triton", inplace_backward=True, old_logps=rest["old_logps"])
        loss.backward()
        assert torch.isfinite(loss)
        grads.append(x.grad[0, -4:].float().clone())
        del x, loss
    assert torch.isfinite(grads[0]).all()
    assert _rel(grads[0], grads[1]) < 1e-2


def test_grad_in_forward_new_lengths_do_not_recompile():
    from grpo_kernels.kernels.logits_loss_kernels import logits_loss_grad_in_forward as kernel
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton version exposes no JIT cache to inspect")

    def call(T, tau, beta):
        x = torch.randn(2, T, 1024, device=DEV, requires_grad=True)
        ids = torch.zeros(2, T, dtype=torch.long, device=DEV)
        loss, _ = gk.grpo_loss(x, ids, torch.ones(2, device=DEV), old_logps=torch.zeros(2, T, device=DEV) - 7,
                               loss_type="grpo", temperature=tau, epsilon_high=beta, impl="triton")
        loss.backward()
    call(2, 1.0, 0.2)
    before = sum(len(entry[0]) for entry in caches.values())
    for T, tau, eps in ((3, 1.0, 0.3), (5, 0.7, 0.28), (17, 1.3, 0.2), (1, 0.5, 0.25)):
        call(T, tau, eps)
    after = sum(len(entry[0]) for entry in caches.values())
    assert after == before, f"{after - before} new variants compiled for new lengths / hyper-parameters"


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_linear_grad_in_forward_on_gpu(dtype, frozen):
    """The gradient-in-forward path (cuBLAS fp32 logits + row-sweep epilogue + cuBLAS dH / fp32 dW) with bias,
    entropy bonus, temperature, KL and is_ratio, in chunks of 700 rows: loss and gradients against fp64 full
    logits, bitwise reproducible, the same as the light path, and on bf16 fp32-output logits GEMMs (no fallback)."""
    case = next(c for c in CASES if c.id == "is-ratio-token")
    from grpo_kernels.planner import head_accumulator_bytes
    # room for ~700 rows of fp32 logits beside the fp32 dW / dbias accumulators (the budget counts them too)
    budget = head_accumulator_bytes(32000, 1024, dtype, dtype, not frozen, not frozen) + 700 * 4 * 32000 + (1 << 20)
    cfg = case.config.replace(entropy_coef=0.02, temperature=0.9, delta=1.3, memory_budget=budget)
    inputs = {k: (v.to(DEV) if torch.is_tensor(v) else v)
              for k, v in make_inputs(case, B=4, T=512, V=32000, hidden_size=1024, dtype=dtype).items()}
    hidden, weight = inputs.pop("hidden"), inputs.pop("weight")
    bias = (torch.randn(32000, device=DEV) * 0.1).to(dtype)
    args = (inputs.pop("ids"), inputs.pop("advantages"), inputs.pop("mask"))

    def run(**kw):
        h, w, b = (t.clone().requires_grad_(not (frozen and t is not hidden)) for t in (hidden, weight, bias))
        loss, _ = gk.fused_linear_grpo_loss(h, w, *args, bias=b, config=cfg, impl="triton", **inputs, **kw)
        wrt = (h,) if frozen else (h, w, b)
        return (loss.detach(), *torch.autograd.grad(loss, wrt))
    ours = run()
    h64, w64, b64 = (t.double().requires_grad_(True) for t in (hidden, weight, bias))
    t_loss, _ = reference_grpo_loss(h64 @ w64.T + b64, *args, config=cfg, **inputs)
    truth = (t_loss.detach(), *torch.autograd.grad(t_loss, (h64,) if frozen else (h64, w64, b64)))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, o, t in zip(("loss", "d hidden", "d weight", "d bias"), ours, truth):
        assert _rel(o, t) <= tol, name
    assert all(torch.equal(a, b) for a, b in zip(ours, run()))
    light = run(grad_in_forward=False)
    for name, o, t in zip(("loss", "d hidden", "d weight", "d bias"), ours, light):
        assert _rel(o, t) <= (1e-5 if dtype == torch.float32 else 1e-2), name
    if dtype == torch.bfloat16:
        from grpo_kernels.kernels.fp32_gemm import fp32_output_gemm_support
        support = fp32_output_gemm_support(hidden.device)
        assert support["mm"] is True, f"torch.mm(out_dtype=float32) unavailable: bf16 logits fallback ({support})"
        if not frozen and support["addmm"] is not True:
            import warnings
            warnings.warn("torch.addmm(fp32 acc, bf16, bf16, out_dtype=float32) unavailable: dW accumulates through "
                          "blocked fp32 temporaries (exact, slower)")


def test_no_grad_linear_logprobs_at_qwen_vocab():
    """linear_token_logprobs under no_grad (cuBLAS fp32 logits + fold) at V = 151936 against fp64."""
    g = torch.Generator(device=DEV).manual_seed(1)
    h = torch.randn(1024, 2048, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(151936, 2048, device=DEV, generator=g) / 20).to(torch.bfloat16)
    ids = torch.randint(0, 151936, (1024,), device=DEV, generator=g)
    with torch.no_grad():
        logp, ent = gk.linear_token_logprobs(h, w, ids, temperature=0.8, return_entropy=True, impl="triton")
        t_logp, t_ent = logprobs_and_entropy(h[:64].double() @ w.double().T, ids[:64], 0.8)
    assert (logp[:64].double() - t_logp).abs().max().item() < 2e-4
    assert (ent[:64].double() - t_ent).abs().max().item() < 2e-4


def test_fused_linear_sequence_level_grad_in_forward_on_gpu():
    """GSPO with KL in chunks of whole sequences (bf16, N = 2048, V = 32000): loss and gradients against fp64."""
    case = next(c for c in CASES if c.id == "sequence-beta")
    from grpo_kernels.planner import head_accumulator_bytes
    # two sequences of 512 per chunk beside the fp32 dW accumulator
    budget = head_accumulator_bytes(32000, 1024, torch.bfloat16, None, True, False) + 1100 * 4 * 32000
    cfg = case.config.replace(memory_budget=budget)
    inputs = {k: (v.to(DEV) if torch.is_tensor(v) else v)
              for k, v in make_inputs(case, B=4, T=512, V=32000, hidden_size=1024, dtype=torch.bfloat16).items()}
    hidden, weight = inputs.pop("hidden"), inputs.pop("weight")
    args = (inputs.pop("ids"), inputs.pop("advantages"), inputs.pop("mask"))
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, _ = gk.fused_linear_grpo_loss(h, w, *args, config=cfg, impl="triton", **inputs)
    ours = (loss.detach(), *torch.autograd.grad(loss, (h, w)))
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    t_loss, _ = reference_grpo_loss(h64 @ w64.T, *args, config=cfg, **inputs)
    truth = (t_loss.detach(), *torch.autograd.grad(t_loss, (h64, w64)))
    for name, o, t in zip(("loss", "d hidden", "d weight"), ours, truth):
        assert _rel(o, t) <= 2e-2, name


@pytest.mark.parametrize("path", ["logits-fast", "logits-sweep", "head-fast", "head-light", "head-light-atomic",
                                  "head-no-grad"])
def test_soft_capped_paths_on_gpu(path):
    """softcap = 5 on logits of spread ~4 (most are bent; some far in the flat part), temperature 0.9, fp32, compiled:
    the GPU's approximate exp2 / rcp in the cap (docs/numerics.md, "Soft-capped logits") against fp64 truth."""
    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    cfg = case.config.replace(softcap=5.0, temperature=0.9, entropy_coef=0.01,
                              grad_in_forward=path in ("logits-fast", "head-fast"),
                              deterministic=path != "head-light-atomic")
    inputs = {k: (v.to(DEV) if torch.is_tensor(v) else v)
              for k, v in make_inputs(case, B=4, T=256, V=5000, hidden_size=256).items()}
    hidden, weight = inputs.pop("hidden"), inputs.pop("weight") * 4
    args = (inputs.pop("ids"), inputs.pop("advantages"), inputs.pop("mask"))
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    if path == "head-no-grad":
        with torch.no_grad():
            logp = gk.linear_token_logprobs(hidden, weight, args[0], temperature=0.9, softcap=5.0, impl="triton")
            t_logp, _ = logprobs_and_entropy(h64 @ w64.T, args[0], 0.9, 5.0)
        assert (logp.double() - t_logp).abs().max().item() < 2e-5
        return
    if path.startswith("logits"):
        x = (hidden @ weight.T).detach().requires_grad_(True)
        loss, _ = gk.grpo_loss(x, *args, config=cfg, impl="triton", **inputs)
        ours = (loss.detach(), *torch.autograd.grad(loss, x))
        x64 = x.detach().double().requires_grad_(True)
        t_loss, _ = reference_grpo_loss(x64, *args, config=cfg, **inputs)
        truth = (t_loss.detach(), *torch.autograd.grad(t_loss, x64))
    else:
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, _ = gk.fused_linear_grpo_loss(h, w, *args, config=cfg, impl="triton", **inputs)
        ours = (loss.detach(), *torch.autograd.grad(loss, (h, w)))
        t_loss, _ = reference_grpo_loss(h64 @ w64.T, *args, config=cfg, **inputs)
        truth = (t_loss.detach(), *torch.autograd.grad(t_loss, (h64, w64)))
    for name, o, t in zip(("loss", "grad 1", "grad 2"), ours, truth):
        assert _rel(o, t) <= 5e-5, name
