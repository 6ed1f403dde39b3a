"""torch.compile(fullgraph=True) with dynamic shapes and dynamic float options (docs/api.md, "torch.compile"): a step
per public function whose float options (temperature, epsilon_low / epsilon_high, beta, num_items_in_batch) are
arguments of the step and change from call to call together with the shapes (B and T), compiled under
``dynamic=True`` (every size and float symbolic from the first call) and under the default automatic dynamic
(``dynamic=None``: the first call static, the second recompiles with what changed symbolic, later calls reuse that
graph). Every call gives eager's loss, metrics and gradients, and a new value of a float option does not recompile:
the floats reach the registered ops as runtime values (``grpo_kernels/ops.py``), not as constants of the graph.
``fused_linear_grpo_loss``'s step builds its ``GRPOLossConfig`` inside the compiled step from the symbolic floats;
``grpo_loss``'s passes them as keyword overrides.

Exact comparisons, no tolerance: the ``aot_eager`` backend generates no code, so the compiled call runs the
registered ops' own bodies (the same kernels) and the traced aten ops on the same values as eager, and a float
option that is an input of the graph is the same float64 number, rounded to the same dtype where it meets a tensor
(``ops.encode``, ``reference._option``), as eager's Python float: the same operations in the same order give the
same bits. (Inductor, which generates code, is compared by the three-way rule in tests/api/test_compile.py.)

Time: each case compiles once or twice (a few seconds to ~15 s on a CPU); one impl per dynamic mode runs in the
fast suite for every function, the other pairings under -m slow (CI's second step).
"""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk

from ..support.compiling import CountingBackend

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # each case counts its own compiles
V, H = 32, 8
# per call: (B, T), temperature, epsilon_low, epsilon_high, beta, num_items_in_batch; all distinct from call to call
CALLS = (((2, 5), 0.7, 0.2, 0.28, 0.04, 9.0), ((3, 7), 0.9, 0.25, 0.3, 0.05, 19.0),
         ((2, 9), 1.1, 0.3, 0.2, 0.06, 15.0), ((3, 6), 1.3, 0.1, 0.35, 0.02, 16.0))


def _batch(B: int, T: int):
    g = torch.Generator().manual_seed(B * 100 + T)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, T - 2:] = 0  # padding: the head's ops compact the valid rows when they run
    adv = torch.randn(B, generator=g)
    old = torch.randn(B, T, generator=g) * 0.1 - 3.0
    return hidden, weight, ids, mask, adv, old, old + 0.05


def _step(name: str, impl: str):
    """The compiled step of one public function: (loss, metrics) from the batch and the call's float options."""
    def token_logprobs(hidden, weight, ids, mask, adv, old, ref, temperature, eps_low, eps_high, beta, n_items):
        logp, ent = gk.token_logprobs(hidden @ weight.T, ids, temperature=temperature, return_entropy=True,
                                      impl=impl)
        return (logp * 0.3 + ent * 0.1).sum(), {"logp": logp.detach(), "entropy": ent.detach()}

    def linear_token_logprobs(hidden, weight, ids, mask, adv, old, ref, temperature, eps_low, eps_high, beta,
                              n_items):
        logp, ent = gk.linear_token_logprobs(hidden, weight, ids, temperature=temperature, return_entropy=True,
                                             impl=impl, mask=mask)
        return (logp * 0.5 - ent * 0.2).sum(), {"logp": logp.detach(), "entropy": ent.detach()}

    def grpo_loss(hidden, weight, ids, mask, adv, old, ref, temperature, eps_low, eps_high, beta, n_items):
        return gk.grpo_loss(hidden @ weight.T, ids, adv, mask, old_logps=old, ref_logps=ref, num_items_in_batch=n_items,
                            impl=impl, temperature=temperature, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta,
                            entropy_coef=0.01)

    def fused_linear_grpo_loss(hidden, weight, ids, mask, adv, old, ref, temperature, eps_low, eps_high, beta,
                               n_items):
        cfg = gk.GRPOLossConfig(temperature=temperature, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta,
                                entropy_coef=0.01)
        return gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old_logps=old, ref_logps=ref,
                                         num_items_in_batch=n_items, config=cfg, impl=impl)

    return locals()[name]


def _run(step, batch, floats):
    hidden = batch[0].clone().requires_grad_(True)
    weight = batch[1].clone().requires_grad_(True)
    loss, metrics = step(hidden, weight, *batch[2:], *floats)
    loss.backward()
    return {"loss": loss.detach(), "d hidden": hidden.grad, "d weight": weight.grad,
            **{f"metric {k}": v for k, v in metrics.items()}}


FUNCTIONS = ("token_logprobs", "linear_token_logprobs", "grpo_loss", "fused_linear_grpo_loss")
# fast: every function under both modes, the torch impl with the automatic dynamic and the Triton impl with
# dynamic=True; the other two pairings are slow
CASES = [pytest.param(name, impl, dynamic, id=f"{name}-{impl}-dynamic={dynamic}",
                      marks=[] if (impl == "torch") == (dynamic is None) else [pytest.mark.slow])
         for name in FUNCTIONS for impl in ("torch", "triton") for dynamic in (None, True)]


@pytest.mark.parametrize("name, impl, dynamic", CASES)
def test_changing_shapes_and_float_options_match_eager_without_a_recompile_per_value(name, impl, dynamic):
    backend = CountingBackend()
    step = _step(name, impl)
    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend=backend)
    warm_up = 1 if dynamic else 2  # the calls after which the graph has the shapes and the floats symbolic
    for i, ((B, T), *floats) in enumerate(CALLS):
        if i == warm_up:
            graphs = backend.graphs
        batch = _batch(B, T)
        eager, ours = _run(step, batch, floats), _run(compiled, batch, floats)
        assert ours.keys() == eager.keys()
        for what in eager:  # exact: module docstring
            assert torch.equal(ours[what], eager[what]), \
                f"B={B} T={T} floats={floats}: compiled {what} differs from eager by " \
                f"{(ours[what].double() - eager[what].double()).abs().max().item():.3e}"
    # dynamic=True: the first call's graph serves every later one; automatic dynamic: the first call's static graph,
    # then the second call's with the shapes and the floats symbolic. A float specialized into the graph would
    # recompile at every call. (The first compile may be traced twice: PyTorch's tensorify pass restarts it once to
    # specialize a module-level float constant the traced code reads, which dynamic=True had made symbolic.)
    assert backend.graphs == graphs, \
        f"{backend.graphs - graphs} recompiles for the {len(CALLS) - warm_up} calls after the first dynamic graph"


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_floats_reach_the_ops_as_graph_inputs(impl):
    """The compiled graph of a step with a float argument takes it as an input (a 0-dim float64 tensor, Dynamo's
    form of an unspecialized float) and passes it to the op inside ``floats``; the value appears nowhere in the
    graph as a constant."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def step(logits, ids, temperature):
        return gk.token_logprobs(logits, ids, temperature=temperature, impl=impl)

    logits, ids = torch.randn(2, 5, V), torch.randint(0, V, (2, 5))
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=backend)
    for temperature in (0.6125, 0.8375):
        assert torch.equal(compiled(logits, ids, temperature), step(logits, ids, temperature))
    assert len(graphs) == 1
    code = graphs[0].code
    assert "0.6125" not in code and "0.8375" not in code
    placeholders = [n for n in graphs[0].graph.nodes if n.op == "placeholder"]
    floats = [n for n in placeholders if isinstance(n.meta.get("example_value"), torch.Tensor)
              and n.meta["example_value"].dtype == torch.float64 and n.meta["example_value"].dim() == 0]
    assert len(floats) == 1, f"graph inputs: {[n.name for n in placeholders]}"


def test_a_config_built_outside_the_step_and_a_crossed_branch():
    """A ``GRPOLoss`` module whose config is replaced between calls (beta, epsilon_high): its floats become symbolic
    once they change, as the step's own arguments do; then beta = 0 (the KL term's branch, traced on the side of the
    first values) compiles one more graph, which a second beta = 0 and later non-zero betas reuse. Every call gives
    eager's loss (exact: module docstring)."""
    backend = CountingBackend()
    module = gk.GRPOLoss(impl="torch")

    def step(logits, ids, adv, ref):
        return module(logits, ids, adv, ref_logps=ref)[0]

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    hidden, weight, ids, mask, adv, old, ref = _batch(2, 5)
    logits = hidden @ weight.T
    counts = []
    for beta, eps_high in ((0.04, 0.2), (0.05, 0.28), (0.06, 0.3), (0.0, 0.25), (0.0, 0.2), (0.07, 0.22)):
        module.config = gk.GRPOLossConfig(beta=beta, epsilon_high=eps_high)
        assert torch.equal(compiled(logits, ids, adv, ref), step(logits, ids, adv, ref)), (beta, eps_high)
        counts.append(backend.graphs)
    # the first values' static graph, the symbolic one (call 2), then the beta = 0 side (call 4; PyTorch may trace
    # it twice: a restart that specializes beta at 0): no compile at calls 3, 5 and 6
    assert counts[2] == counts[1] and counts[4] == counts[5] == counts[3], counts


@pytest.mark.parametrize("name", ["token_logprobs", "linear_token_logprobs"])
def test_a_changing_soft_cap_is_symbolic_too(name):
    """A soft cap changing at every call (``dynamic=True``) reaches the ops as a runtime value like the other floats:
    one graph, the log-probs and gradients of the graph compiled with the cap a constant (``dynamic=False``, one
    graph per cap; exact: the same ops on the same values) and eager's log-probs. (Why not eager's gradients
    bitwise: with a cap they differ from any compiled graph's by ~1 ulp, the cap a constant or not. The plans'
    soft-cap note is not written while compiling: a symbolic cap has no printed value.)"""
    backend = CountingBackend()

    def step(hidden, weight, ids, softcap):
        if name == "token_logprobs":
            return gk.token_logprobs(hidden @ weight.T, ids, softcap=softcap, impl="torch")
        return gk.linear_token_logprobs(hidden, weight, ids, softcap=softcap, impl="torch")

    def run(fn, softcap):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logp = fn(h, w, ids, softcap)
        logp.sum().backward()
        return logp.detach(), h.grad, w.grad

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=backend)
    constant = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    hidden, weight, ids = _batch(2, 5)[:3]
    for softcap in (5.0, 3.5, 7.25):
        ours, static = run(compiled, softcap), run(constant, softcap)
        for what, a, b in zip(("logp", "d hidden", "d weight"), ours, static):
            assert torch.equal(a, b), (softcap, what, (a - b).abs().max())
        assert torch.equal(ours[0], step(hidden, weight, ids, softcap)), softcap
    assert backend.graphs <= 2, f"{backend.graphs} compiles for 3 soft caps"  # 2: the restart (module docstring)
