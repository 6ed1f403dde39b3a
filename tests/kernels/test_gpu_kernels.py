"""Compiled Triton kernels on a CUDA GPU (skipped elsewhere; `benchmarks/gpu_check.sh` runs this file first).

On CPU the same kernels are covered under TRITON_INTERPRET=1 by the other test files; here they run compiled, at
sizes the interpreter cannot reach (V = 151936, B*T*V > 2^31). Every result is held to float64 ground truth by the
three-way rule (tests/support/tolerances.py), the middle term plain PyTorch in the inputs' dtype on the same GPU
and inputs: no bound here is a constant. The comparisons are tests/support/device_checks.py's, which
tests/kernels/test_device_checks.py runs on CPU tensors.
"""
import pytest
import torch

import grpo_kernels as gk

from ..support.cases import CASES, make_inputs
from ..support.device_checks import (check_head, check_logits_loss, check_logits_loss_call, check_logprobs_rows,
                                     check_token_logprobs, head_loss, head_truths, logits_loss, to_device)
from ..support.tolerances import loss_truth_and_same_dtype

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU; runs in benchmarks/gpu_check.sh")]
DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_path_at_qwen_vocab(dtype):
    """B*T = 2048 tokens, V = 151936: log-prob, entropy and d logits against the fp64 reference on the GPU."""
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = (torch.randn(2, 1024, 151936, device=DEV, generator=g) * 2).to(dtype)
    ids = torch.randint(0, 151936, (2, 1024), device=DEV, generator=g)
    a = torch.randn(2, 1024, device=DEV, generator=g)
    # float64 ground truth on a slice of the positions keeps the check within memory
    check_token_logprobs(logits, ids, 0.9, a, rows=slice(0, 64), what=f"qwen vocab {dtype}")


def test_int64_offsets_beyond_2_to_the_31():
    """16384 x 151936 bf16 logits (2.5e9 elements): the last rows are right (int32 offsets would wrap)."""
    logits = torch.randn(1, 16384, 151936, device=DEV, dtype=torch.bfloat16)
    ids = torch.randint(0, 151936, (1, 16384), device=DEV)
    with torch.no_grad():
        logp = gk.token_logprobs(logits, ids, impl="triton")
    check_logprobs_rows((logp[:, -8:],), logits[:, -8:], logits[:, -8:].double(), ids[:, -8:], 1.0,
                        what="the last rows of 2.5e9 logits")


@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["grad-in-forward", "separate"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_grpo_loss_matches_reference_on_gpu(case, grad_in_forward):
    inputs = to_device(make_inputs(case, V=5000), DEV)
    check_logits_loss_call(inputs, case.config.replace(grad_in_forward=grad_in_forward), what=case.id)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_linear_loss_on_gpu(dtype, deterministic):
    """N = 2048, H = 1024, V = 32000: loss and gradients against fp64 full logits; deterministic mode is
    bitwise reproducible."""
    case = next(c for c in CASES if c.id == "everything")
    inputs = to_device(make_inputs(case, B=4, T=512, V=32000, hidden_size=1024, dtype=dtype), DEV)
    ours = head_loss(inputs, case.config, deterministic=deterministic)
    check_head(ours, head_truths(inputs, case.config), dtype, f"{dtype} deterministic={deterministic}")
    if deterministic:
        again = head_loss(inputs, case.config, deterministic=deterministic)
        assert torch.equal(ours[0], again[0]) and all(torch.equal(a, b) for a, b in zip(ours[1], again[1]))


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
    """``make_inputs``-style inputs at a real vocabulary: row 2 (when B = 2) a third valid, old and ref log-probs."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = (torch.randn(B, T, V, device=DEV, generator=g) * 2).to(dtype)
    ids = torch.randint(0, V, (B, T), device=DEV, generator=g)
    mask = torch.arange(T, device=DEV) < torch.tensor([T, T // 3], device=DEV)[:B].unsqueeze(1)
    logp = torch.randn(B, T, device=DEV, generator=g) * 0.1 - 3
    return {"logits": logits, "ids": ids, "mask": mask, "advantages": torch.tensor([1.0, -0.5], device=DEV)[:B],
            "old_logps": logp, "ref_logps": logp - 0.1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grad_in_forward_at_qwen_vocab(dtype):
    """B=2, T=1024, V=151936, dapo with KL and an entropy bonus, a third of row 2 valid, the loss scaled by 3: the
    grad-in-forward kernel (new buffer and in place, bitwise the same) and the separate sweeps against the float64
    reference on the whole batch."""
    inputs = _qwen_batch(2, 1024, 151936, dtype)
    cfg = gk.GRPOLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01, temperature=0.9)
    truths = loss_truth_and_same_dtype(inputs, cfg)  # float64 on all of it: ~20 GB of a 141 GB H200
    results = {}
    for name, gif, inplace in (("gif", True, False), ("gif-inplace", True, True), ("separate", False, False)):
        loss, grad, x = logits_loss(inputs, cfg.replace(grad_in_forward=gif), upstream=3.0,
                                    inplace_backward=inplace)
        check_logits_loss((loss, grad), truths, dtype, f"{name} {dtype}", upstream=3.0)
        results[name] = (loss, grad)
        if inplace:
            assert grad.data_ptr() == x.data_ptr()
    assert torch.equal(results["gif"][1], results["gif-inplace"][1])
    assert (results["gif"][1][1, 1024 // 3:] == 0).all(), "padded tokens must get zero gradient"


def test_grad_in_forward_long_row():
    """B=1, T=131072, V=32768 bf16 (a 1-D grid; T >= 65536 breaks a 2-D one): finite loss, and the gradient of the
    last positions, both kernels, against float64 truth. grpo without KL is per-token but for its row normalizer, so
    the truth of the last 4 positions is the same loss on those positions alone times 4 / T (their share of the
    row's tokens; the whole row is valid)."""
    inputs = _qwen_batch(1, 131072, 32768, torch.bfloat16, seed=1)
    del inputs["ref_logps"]
    cfg = gk.GRPOLossConfig(loss_type="grpo")
    tail = {k: (v[:, -4:] if torch.is_tensor(v) and v.dim() > 1 else v) for k, v in inputs.items()}
    truths = loss_truth_and_same_dtype(tail, cfg)
    fraction = tail["mask"].sum().item() / inputs["mask"].sum().item()
    for gif in (True, False):
        loss, grad, x = logits_loss(inputs, cfg.replace(grad_in_forward=gif), inplace_backward=True)
        assert torch.isfinite(loss)
        check_logits_loss((loss, grad[:, -4:]), truths, torch.bfloat16, f"grad_in_forward={gif}", fraction=fraction)
        del loss, grad, x


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
    logits, bitwise reproducible, the light path against the same truth, and on bf16 fp32-output logits GEMMs (no
    fallback)."""
    case = next(c for c in CASES if c.id == "is-ratio-token")
    from grpo_kernels.planner import head_accumulator_bytes
    # room for ~700 rows of fp32 logits beside the fp32 dW / dbias accumulators (the budget counts them too)
    budget = head_accumulator_bytes(32000, 1024, dtype, dtype, not frozen, not frozen) + 700 * 4 * 32000 + (1 << 20)
    cfg = case.config.replace(entropy_coef=0.02, temperature=0.9, delta=1.3, memory_budget=budget)
    inputs = to_device(make_inputs(case, B=4, T=512, V=32000, hidden_size=1024, dtype=dtype), DEV)
    bias = (torch.randn(32000, device=DEV) * 0.1).to(dtype)
    truths = head_truths(inputs, cfg, bias)
    ours = head_loss(inputs, cfg, bias, frozen)
    check_head(ours, truths, dtype, f"grad-in-forward {dtype}")
    again = head_loss(inputs, cfg, bias, frozen)
    assert torch.equal(ours[0], again[0]) and all(torch.equal(a, b) for a, b in zip(ours[1], again[1]))
    check_head(head_loss(inputs, cfg, bias, frozen, grad_in_forward=False), truths, dtype, f"light {dtype}")
    if dtype == torch.bfloat16:
        from grpo_kernels.kernels.fp32_gemm import fp32_output_gemm_support
        support = fp32_output_gemm_support(inputs["hidden"].device)
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
    # the middle term: plain PyTorch's bf16 logits of the first 64 rows
    check_logprobs_rows((logp[:64], ent[:64]), h[:64] @ w.T, h[:64].double() @ w.double().T, ids[:64], 0.8,
                        what="no-grad head")


def test_fused_linear_sequence_level_grad_in_forward_on_gpu():
    """GSPO with KL in chunks of whole sequences (bf16, N = 2048, V = 32000): loss and gradients against fp64."""
    case = next(c for c in CASES if c.id == "sequence-beta")
    from grpo_kernels.planner import head_accumulator_bytes
    # two sequences of 512 per chunk beside the fp32 dW accumulator
    budget = head_accumulator_bytes(32000, 1024, torch.bfloat16, None, True, False) + 1100 * 4 * 32000
    cfg = case.config.replace(memory_budget=budget)
    inputs = to_device(make_inputs(case, B=4, T=512, V=32000, hidden_size=1024, dtype=torch.bfloat16), DEV)
    check_head(head_loss(inputs, cfg), head_truths(inputs, cfg), torch.bfloat16, "sequence-level")


@pytest.mark.parametrize("path", ["logits-fast", "logits-sweep", "head-fast", "head-light", "head-light-atomic",
                                  "head-no-grad"])
def test_soft_capped_paths_on_gpu(path):
    """softcap = 5 on logits of spread ~4 (most are bent; some far in the flat part), temperature 0.9, fp32, compiled:
    the GPU's approximate exp2 / rcp in the cap (docs/numerics.md, "Soft-capped logits") against fp64 truth."""
    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    cfg = case.config.replace(softcap=5.0, temperature=0.9, entropy_coef=0.01,
                              grad_in_forward=path in ("logits-fast", "head-fast"),
                              deterministic=path != "head-light-atomic")
    inputs = to_device(make_inputs(case, B=4, T=256, V=5000, hidden_size=256), DEV)
    inputs["weight"] = inputs["weight"] * 4
    hidden, weight = inputs["hidden"], inputs["weight"]
    if path == "head-no-grad":
        with torch.no_grad():
            logp = gk.linear_token_logprobs(hidden, weight, inputs["ids"], temperature=0.9, softcap=5.0,
                                            impl="triton")
        check_logprobs_rows((logp,), hidden @ weight.T, hidden.double() @ weight.double().T, inputs["ids"], 0.9,
                            5.0, what=path)
    elif path.startswith("logits"):
        logits_inputs = {k: v for k, v in inputs.items() if k not in ("hidden", "weight")}
        logits_inputs["logits"] = hidden @ weight.T
        check_logits_loss_call(logits_inputs, cfg, what=path)
    else:
        check_head(head_loss(inputs, cfg), head_truths(inputs, cfg), torch.float32, path)
