"""Bad input raises a ValueError naming the argument; nothing the caller passed is modified."""
import pytest
import torch

import grpo_kernels as gk

B, T, V, H = 2, 3, 11, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    return {"logits": torch.randn(B, T, V, generator=g), "ids": torch.randint(0, V, (B, T), generator=g),
            "advantages": torch.randn(B, generator=g)}


BAD_LOSS_CALLS = {
    "ids-shape": (dict(ids=torch.zeros(B, T + 1, dtype=torch.long)), "ids"),
    "ids-dtype": (dict(ids=torch.zeros(B, T)), "ids"),
    "ids-too-large": (dict(ids=torch.full((B, T), V)), r"ids must lie in \[0, V\)"),
    "ids-negative": (dict(ids=torch.full((B, T), -1)), r"ids must lie in \[0, V\)"),
    "logits-dtype": (dict(logits=torch.zeros(B, T, V, dtype=torch.int32)), "logits"),
    "logits-2d": (dict(logits=torch.zeros(B * T, V)), "logits"),
    "advantages-shape": (dict(advantages=torch.zeros(B + 1)), "advantages"),
    "mask-shape": (dict(mask=torch.ones(B, T + 1)), "mask"),
    "old-shape": (dict(old_logps=torch.zeros(B, T + 1)), "old_logps"),
    "ref-shape": (dict(ref_logps=torch.zeros(B), beta=0.1), "ref_logps"),
    "is-ratio-shape": (dict(is_ratio=torch.ones(B, 2)), "is_ratio"),
    "num-items-negative": (dict(num_items_in_batch=-3), "num_items_in_batch"),
    "temperature-zero": (dict(temperature=0.0), "temperature"),
    "temperature-negative": (dict(temperature=-1.0), "temperature"),
    "loss-type": (dict(loss_type="ppo"), "loss_type"),
    "eps-low-range": (dict(epsilon_low=1.5), "epsilon_low"),
    "eps-high-range": (dict(epsilon_high=-0.1), "epsilon_high"),
    "eps-nan": (dict(epsilon_high=float("nan")), "epsilon_high"),
    "beta-without-ref": (dict(beta=0.04), "ref_logps"),
    "importance-level": (dict(importance_sampling_level="row"), "importance_sampling_level"),
    "top-entropy-range": (dict(top_entropy_quantile=0.0), "top_entropy_quantile"),
    "unknown-option": (dict(epsilon=0.2), "unknown GRPO loss option"),
    "impl": (dict(impl="cuda"), "impl"),
    "delta-negative": (dict(delta=-1.0), "delta"),
    "max-completion-length": (dict(max_completion_length=0), "max_completion_length"),
}


@pytest.mark.parametrize("bad", BAD_LOSS_CALLS.values(), ids=BAD_LOSS_CALLS.keys())
def test_grpo_loss_bad_input(bad):
    overrides, message = bad
    kwargs = _inputs()
    kwargs["impl"] = "torch"
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=message):
        gk.grpo_loss(**kwargs)


BAD_LINEAR_CALLS = {
    "weight-shape": (dict(weight=torch.zeros(V, H + 1)), "weight"),
    "weight-dtype": (dict(weight=torch.zeros(V, H, dtype=torch.float16)), "weight dtype"),
    "hidden-1d": (dict(hidden=torch.zeros(H)), "hidden"),
    "ids-count": (dict(ids=torch.zeros(B, T + 1, dtype=torch.long)), "ids"),
    "ids-range": (dict(ids=torch.full((B, T), V)), r"ids must lie in \[0, V\)"),
    "bias-shape": (dict(bias=torch.zeros(V + 1)), "bias"),
    "temperature": (dict(temperature=float("inf")), "temperature"),
}


@pytest.mark.parametrize("bad", BAD_LINEAR_CALLS.values(), ids=BAD_LINEAR_CALLS.keys())
def test_fused_linear_bad_input(bad):
    overrides, message = bad
    g = torch.Generator().manual_seed(1)
    kwargs = {"hidden": torch.randn(B, T, H, generator=g), "weight": torch.randn(V, H, generator=g),
              "ids": torch.randint(0, V, (B, T), generator=g), "advantages": torch.randn(B, generator=g)}
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=message):
        gk.fused_linear_grpo_loss(**kwargs, impl="torch")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        gk.token_logprobs(torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), impl="triton")


def test_environment_override_of_impl(monkeypatch):
    monkeypatch.setenv("GRPO_KERNELS_IMPL", "bogus")
    with pytest.raises(ValueError, match="GRPO_KERNELS_IMPL"):
        gk.token_logprobs(torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long))


@pytest.mark.interpreter
def test_triton_rejects_float64_clearly():
    with pytest.raises(ValueError, match="float64"):
        gk.token_logprobs(torch.randn(1, 2, 5, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.long),
                          impl="triton")


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="group_size"):
        gk.group_advantages(torch.randn(6), 4)
    with pytest.raises(ValueError, match="scale"):
        gk.group_advantages(torch.randn(4), 2, scale="global")
    with pytest.raises(ValueError, match="weights"):
        gk.group_advantages(torch.randn(4, 2), 2, weights=[1.0, 2.0, 3.0])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_inputs_are_not_modified(impl):
    kwargs = _inputs()
    kwargs["logits"].requires_grad_(True)
    old = torch.randn(B, T)
    snapshot = {k: v.detach().clone() for k, v in kwargs.items()}
    old_copy = old.clone()
    loss, _ = gk.grpo_loss(**kwargs, old_logps=old, impl=impl, loss_type="grpo")
    loss.backward()
    for k, v in kwargs.items():
        assert torch.equal(v.detach(), snapshot[k]), k
    assert torch.equal(old, old_copy)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("entry", ["grpo_loss", "fused_linear_grpo_loss"])
@pytest.mark.parametrize("bad,name", [
    (dict(beta=-0.1), "beta"), (dict(epsilon_low=-0.1), "epsilon_low"), (dict(epsilon_high=-0.2), "epsilon_high"),
    (dict(num_items_in_batch=0), "num_items_in_batch"), (dict(num_items_in_batch=torch.tensor(0.0)),
                                                         "num_items_in_batch"),
    (dict(is_ratio=torch.tensor([1.0, -0.5])), "is_ratio")], ids=lambda v: v if isinstance(v, str) else None)
def test_library_guards_name_the_argument(entry, impl, bad, name):
    """beta < 0, a negative epsilon, num_items_in_batch <= 0 and a negative is_ratio are refused by every entry point
    on both impls, with a ValueError naming the argument."""
    import grpo_kernels as gk
    g = torch.Generator().manual_seed(0)
    ids, adv = torch.randint(0, 11, (2, 3), generator=g), torch.randn(2, generator=g)
    if entry == "grpo_loss":
        args = (torch.randn(2, 3, 11, generator=g, requires_grad=True), ids, adv)
    else:
        args = (torch.randn(2, 3, 8, generator=g, requires_grad=True), torch.randn(11, 8, generator=g), ids, adv)
    with pytest.raises(ValueError, match=name):
        getattr(gk, entry)(*args, impl=impl, loss_type="dapo", **bad)


def test_inplace_backward_refuses_overlapping_logits():
    """d logits written in place into an expanded tensor (rows sharing memory) would be wrong: refused."""
    import grpo_kernels as gk
    row = torch.randn(1, 1, 11)
    logits = row.expand(2, 3, 11)
    with pytest.raises(ValueError, match="inplace_backward"):
        gk.grpo_loss(logits, torch.zeros(2, 3, dtype=torch.long), torch.ones(2), inplace_backward=True, impl="torch")
    with pytest.raises(ValueError, match="inplace_backward"):
        gk.token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), inplace_backward=True)
