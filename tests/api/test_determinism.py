"""Determinism as documented (docs/numerics.md, "Determinism"): with ``deterministic=True`` (the default) no path
runs an operation whose result depends on the order of a GPU's atomic updates.

A dispatch mode lists the aten ops that are nondeterministic on CUDA: accumulating scatters (``index_add_``,
``index_put_(accumulate=True)``, ``scatter_add``, ``scatter_reduce``, ``index_reduce``, ``put_(accumulate=True)``,
the embedding backward), and indexed writes whose indices repeat (``index_put_``, ``index_copy``, ``scatter``: which
write lands last varies). A spy on the Triton kernels that call ``tl.atomic_*`` records their launches. Every path
runs forward and backward under both, on CPU tensors (the Triton paths under the interpreter), the vocab-parallel
ones on a one-rank gloo group."""
from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_kernels as gk

ACCUMULATING = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
                "index_reduce", "index_reduce_", "embedding_dense_backward", "_embedding_bag_backward"}
# (op, position of its index argument) of the indexed writes that are nondeterministic where indices repeat
WRITES = {"index_copy": 2, "index_copy_": 2}


def _repeats(index) -> bool:
    return isinstance(index, torch.Tensor) and index.numel() > 0 and index.unique().numel() < index.numel()


def _scatter_repeats(target: torch.Tensor, dim: int, index: torch.Tensor) -> bool:
    """Whether ``target.scatter(dim, index, ...)`` writes some element twice: the destinations are the index's own
    coordinates with the ``dim`` one replaced by its values."""
    coords = list(torch.meshgrid(*[torch.arange(n) for n in index.shape], indexing="ij"))
    coords[dim % index.dim()] = index
    strides = torch.tensor(target.stride()[:index.dim()]) if target.dim() else torch.tensor([1])
    flat = sum(c.reshape(-1) * s for c, s in zip(coords, strides.tolist()))
    return _repeats(flat)


class NondeterministicOps(TorchDispatchMode):
    """Records every op that is nondeterministic on CUDA, as it is called here."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        overload = func._overloadname
        accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
        if name in ACCUMULATING or (name in ("put", "put_") and accumulate) or \
                (name in ("scatter", "scatter_") and ("reduce" in kwargs or "reduce" in overload)):
            self.found.append(name)
        elif name in ("index_put", "index_put_", "_index_put_impl_"):
            indices = [t for t in args[1] if t is not None]
            if accumulate or (len(indices) == 1 and indices[0].dtype != torch.bool and _repeats(indices[0])):
                self.found.append(f"{name}(accumulate={bool(accumulate)})")
        elif name in WRITES and _repeats(args[WRITES[name]]):
            self.found.append(f"{name} with repeated indices")
        elif name in ("scatter", "scatter_") and _scatter_repeats(args[0], args[1], args[2]):
            self.found.append(f"{name} with repeated destinations")
        return func(*args, **kwargs)


def _atomic_kernels():
    """(module, attribute) of every Triton kernel of the package whose source calls tl.atomic_*."""
    import importlib
    import pkgutil

    from grpo_kernels import kernels
    found = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"grpo_kernels.kernels.{info.name}")
        for attr, value in vars(module).items():
            fn = getattr(value, "fn", None)
            if fn is not None and "tl.atomic_" in inspect.getsource(fn):
                found.append((module, attr))
    return found


class _Spy:
    def __init__(self, kernel, name, launches):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        self.launches.append(self.name)
        return self.kernel[grid]


@contextlib.contextmanager
def watching(monkeypatch):
    """(nondeterministic aten ops, atomic Triton launches) of the code run inside."""
    launches = []
    for module, attr in _atomic_kernels():
        monkeypatch.setattr(module, attr, _Spy(getattr(module, attr), attr, launches))
    mode = NondeterministicOps()
    with mode:
        yield mode.found, launches


B, T, V, H = 3, 6, 37, 8


def _batch():
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    ids = torch.randint(0, 5, (B, T), generator=g)  # few distinct ids: every id repeats
    return dict(hidden=torch.randn(B, T, H, generator=g), weight=torch.randn(V, H, generator=g) / 3,
                bias=torch.randn(V, generator=g) / 5, logits=torch.randn(B, T, V, generator=g), ids=ids, mask=mask,
                adv=torch.randn(B, generator=g), old=torch.randn(B, T, generator=g) - 3,
                ref=torch.randn(B, T, generator=g) - 3)


CONFIGS = {
    "token-level": dict(loss_type="dapo", beta=0.04, entropy_coef=0.01),
    "sequence-level": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "entropy-mask": dict(loss_type="bnpo", top_entropy_quantile=0.5),
    "recompute": dict(loss_type="dr_grpo", grad_in_forward=False),
}


def _calls(b, impl, cfg, process_group=None):
    def head():
        h, w, bias = (b[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
        loss, _ = gk.fused_linear_grpo_loss(h, w, b["ids"], b["adv"], b["mask"], bias=bias, old_logps=b["old"],
                                            ref_logps=b["ref"], impl=impl, process_group=process_group, **cfg)
        loss.backward()

    def logits():
        x = b["logits"].clone().requires_grad_(True)
        loss, _ = gk.grpo_loss(x, b["ids"], b["adv"], b["mask"], old_logps=b["old"], ref_logps=b["ref"], impl=impl,
                               **cfg)
        loss.backward()

    def head_logprobs():
        h, w = (b[k].clone().requires_grad_(True) for k in ("hidden", "weight"))
        gk.linear_token_logprobs(h, w, b["ids"], mask=b["mask"], impl=impl, process_group=process_group).sum() \
            .backward()

    return (head, head_logprobs) if process_group is not None else (head, logits, head_logprobs)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_deterministic_paths_run_no_nondeterministic_op(impl, config, monkeypatch, knobs, plans):
    knobs(fast_path_min_rows=1)
    b = _batch()
    for call in _calls(b, impl, CONFIGS[config]):
        with watching(monkeypatch) as (ops, atomics):
            call()
        assert (ops, atomics) == ([], []), f"{call.__name__} on {plans[-1].path}"


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("config", ["token-level", "recompute"])
def test_vocab_parallel_paths_run_no_nondeterministic_op(config, one_rank_group, monkeypatch, knobs, plans):
    """The vocab-parallel paths (the fast one, and the light one with its target-logit gradient rows)."""
    knobs(fast_path_min_rows=1)
    b = _batch()
    for call in _calls(b, "triton", CONFIGS[config], process_group=one_rank_group):
        with watching(monkeypatch) as (ops, atomics):
            call()
        assert (ops, atomics) == ([], []), f"{call.__name__} on {plans[-1].path}"


def test_the_watch_sees_nondeterminism(monkeypatch, knobs, one_rank_group):
    """The watch can fail: deterministic=False runs the atomic Triton backward and the target logits' index_add_."""
    b = _batch()
    with watching(monkeypatch) as (ops, atomics):
        h, w = (b[k].clone().requires_grad_(True) for k in ("hidden", "weight"))
        gk.linear_token_logprobs(h, w, b["ids"], mask=b["mask"], impl="triton", deterministic=False,
                                 process_group=one_rank_group).sum().backward()
    assert "index_add_" in ops and atomics == ["linear_bwd_atomic_kernel"]
    with watching(monkeypatch) as (ops, _):
        torch.zeros(4).index_put_((torch.tensor([1, 1]),), torch.ones(2))
        torch.zeros(4).index_copy_(0, torch.tensor([0, 2]), torch.ones(2))  # distinct: deterministic
    assert ops == ["index_put_(accumulate=False)"]
