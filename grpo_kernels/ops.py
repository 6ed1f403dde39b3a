"""The boundary between a path's eager and compiled calls, defined once (docs/DESIGN.md, "One body per path").

Every path's compute (kernels, chunk loop, sums, gradient hand-out) is one body function in the path's module. Two
thin callers share it: the eager ``torch.autograd.Function`` and, under ``torch.compile``, the path's registered
``torch.library.custom_op`` (Dynamo cannot trace Triton launches or Python chunk loops; an op stays one opaque node
whose fake implementation gives the output shapes and whose autograd registration gives AOTAutograd the backward).
The eager Function keeps the savings only an eager call can make (docs/api.md, "torch.compile"): d logits written
into the logits buffer, gradients scaled in place when handed out, a ZeRO-3 head gathered again in the backward.

What crosses an op boundary besides tensors is one pair, ``floats`` and ``ints`` (an op takes no dataclass): the
frozen option objects (the loss options, the logits transform, a path's layout) are encoded by ``encode`` and
rebuilt by ``decode`` here alone, from the schema ``options_type`` records for each class. ``floats`` is a float64
CPU tensor, not a list of floats: under torch.compile a float option may be symbolic (the compiler's automatic
dynamic, or ``dynamic=True``), and a symbolic float passed to an op as a float is specialized (the graph takes its
value as a constant and recompiles for every new one), while one added to a tensor becomes an input of the graph
(PyTorch's tensorify pass); the op reads the values when it runs (a CPU tensor: no device sync). ``ints`` stays a
list: a size computed from symbolic shapes stays symbolic there. The ops (``torch.ops.grpo_kernels.<name>``):

- ``logits_logprobs`` / ``logits_logprobs_backward`` (``logits/logprobs.py``): ``logits.sweep``, ``logits.torch``;
- ``head_logprobs`` / ``head_logprobs_backward`` (``head/light.py``): ``head.light``, ``head.no_grad``,
  ``head.torch``;
- ``token_stage`` (``token_stage.py``): the Triton per-token stage after a sweep;
- ``logits_loss_fast`` (``logits/fast.py``): ``logits.fast``;
- ``head_loss_fast`` (``head/fast.py``): ``head.fast``.
"""
from __future__ import annotations

import dataclasses
import math
import typing

import torch

from ._checks import ROUND_LOGITS
from .config import IMPORTANCE_SAMPLING_LEVELS, GRPOLossConfig, LogitTransform, TokenExtras
from .loss_types import LOSS_TYPES

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# (class) -> ((field, kind, choices), ...): kind "nested" | "choice" | "dtype" | "bool" | "int" | "float"; for a
# float field, "choices" is its default (what ``decode_for_fake`` gives it)
_SCHEMAS: dict = {}


def options_type(cls=None, *, choices: dict | None = None):
    """Record a frozen dataclass's schema so that its instances can cross an op boundary (``encode`` / ``decode``).
    choices: for each str field, its allowed values (encoded as their index). Usable as a class decorator."""
    def register(klass):
        hints = typing.get_type_hints(klass)
        schema = []
        for f in dataclasses.fields(klass):
            hint = hints[f.name]
            args = tuple(a for a in typing.get_args(hint) if a is not type(None)) or (hint,)
            if args[0] in _SCHEMAS:
                kind, extra = "nested", args[0]
            elif choices and f.name in choices:
                kind, extra = "choice", tuple(choices[f.name])
            elif args[0] is torch.dtype:
                kind, extra = "dtype", _DTYPES
            elif args[0] is float:
                if f.default is dataclasses.MISSING:  # a fake kernel decodes without the floats
                    raise TypeError(f"{klass.__name__}.{f.name}: a float option needs a default to cross an op "
                                    "boundary")
                kind, extra = "float", f.default
            elif args[0] in (bool, int):
                kind, extra = args[0].__name__, None
            else:
                raise TypeError(f"{klass.__name__}.{f.name}: {hint} cannot cross an op boundary")
            schema.append((f.name, kind, extra))
        _SCHEMAS[klass] = tuple(schema)
        return klass
    return register(cls) if cls is not None else register


def encode(obj) -> tuple[torch.Tensor, list]:
    """``obj`` (a registered option object) as (floats, ints), the two arguments every op takes: the float fields in
    ``floats``, a float64 CPU tensor (None as NaN; each value added to a zero, so that a symbolic float reaches the
    op as a runtime value, module docstring); every other field in ``ints`` (a str as its index among the field's
    choices, a dtype as its index, a bool as 0 / 1, an optional int as a present flag and its value). Why ints apart:
    a size computed from symbolic shapes under torch.compile stays symbolic in a list of ints (a varying T does not
    recompile). Written for Dynamo to trace (a loop over a constant schema)."""
    values, ints = _encode_into(obj, [], [])
    if not values:
        return torch.zeros((0,), dtype=torch.float64), ints
    zero = torch.zeros((), dtype=torch.float64)
    return torch.stack([zero + v for v in values]), ints


def _encode_into(obj, floats: list, ints: list) -> tuple[list, list]:
    for name, kind, extra in _SCHEMAS[type(obj)]:
        value = getattr(obj, name)
        if kind == "nested":
            _encode_into(value, floats, ints)
        elif kind == "float":
            floats.append(math.nan if value is None else value)
        elif kind in ("choice", "dtype"):
            ints.append(extra.index(value))
        elif kind == "bool":
            ints.append(1 if value else 0)
        else:  # int, possibly None
            ints += [0, 0] if value is None else [1, value]
    return floats, ints


def decode(cls, floats, ints):
    """The ``cls`` instance that ``encode`` gave (floats, ints) for; floats: its tensor (read here: the op is
    running, on a CPU tensor) or a list of the same numbers."""
    values = floats.tolist() if isinstance(floats, torch.Tensor) else list(floats)
    return _decode_checked(cls, values, ints)


def decode_for_fake(cls, ints):
    """The ``cls`` instance of ``ints`` with every float option at its default: what a fake kernel decodes, since it
    cannot read the floats tensor (no values under fake tensors); the output shapes and dtypes depend on no float
    option."""
    return _decode_checked(cls, None, ints)


def _decode_checked(cls, values, ints):
    try:
        obj, used = _decode_from(cls, values, ints, [0, 0])
    except IndexError:  # too few values (the schema reads past the lists): a ValueError, as for too many
        raise ValueError(f"{len(values)} float and {len(ints)} int option values for {cls.__name__}: too few") \
            from None
    if used != [used[0] if values is None else len(values), len(ints)]:
        raise ValueError(f"{len(values)} float and {len(ints)} int option values for {cls.__name__}, which takes "
                         f"{used[0]} and {used[1]}")
    return obj


def _decode_from(cls, floats, ints, pos: list):
    """floats None: each float field at its default (``decode_for_fake``)."""
    kwargs = {}
    for name, kind, extra in _SCHEMAS[cls]:
        if kind == "nested":
            kwargs[name], pos = _decode_from(extra, floats, ints, pos)
        elif kind == "float":
            value = extra if floats is None else floats[pos[0]]
            kwargs[name] = None if value is None or math.isnan(value) else float(value)
            pos = [pos[0] + 1, pos[1]]
        elif kind == "int":
            present, value = ints[pos[1]], ints[pos[1] + 1]
            kwargs[name] = value if present else None  # no int(): a symbolic size stays symbolic
            pos = [pos[0], pos[1] + 2]
        else:
            value = ints[pos[1]]
            kwargs[name] = bool(value) if kind == "bool" else extra[int(value)]
            pos = [pos[0], pos[1] + 1]
    return cls(**kwargs), pos


# None first: the option off encodes as 0
_ROUNDINGS = (None,) + ROUND_LOGITS
options_type(LogitTransform, choices={"round_logits": _ROUNDINGS})
options_type(TokenExtras)
options_type(GRPOLossConfig, choices={"loss_type": LOSS_TYPES, "round_logits": _ROUNDINGS,
                                      "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS})


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The PyTorch paths' accumulation dtype: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def valid_index(row_mask, n: int):
    """The flat indices of the rows ``row_mask`` keeps, or None for all ``n``: the compaction of ``ValidRows``, made
    by an op when it runs (``ValidRows.deferred``) because its size depends on the data."""
    if row_mask is None:
        return None
    index = (row_mask.reshape(-1) != 0).nonzero().squeeze(1)
    return None if index.numel() == n else index


def take_rows(index, *tensors):
    """Each tensor's rows at ``index`` (None: all rows; None tensors stay None)."""
    return tuple(t if t is None or index is None else t.index_select(0, index) for t in tensors)


def put_rows(index, n: int, t):
    """A compact tensor back on all ``n`` rows, zeros at the rows left out."""
    if t is None or index is None:
        return t
    return torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=t.device).index_copy_(0, index, t)


def or_empty(t, like: torch.Tensor):
    """``t``, or an empty (0,) tensor standing for None (an op returns no None)."""
    return like.new_empty((0,)) if t is None else t


def compiling() -> bool:
    """Whether Dynamo is tracing the call (then the entry points call the paths' ops, not their Functions)."""
    return torch.compiler.is_compiling()


def check_head_compilable(process_group, gather_head) -> None:
    """Under torch.compile, refuse the sharded heads: their collectives and gather contexts run in Python around
    the kernels, outside any op."""
    if not compiling():
        return
    if process_group is not None:
        raise ValueError("process_group (a vocab-parallel head) is not supported under torch.compile; call the "
                         "function outside the compiled region")
    if gather_head is not None:
        raise ValueError("gather_head (a ZeRO-3 partitioned head) is not supported under torch.compile; call the "
                         "function outside the compiled region")


def grads_for_inputs(ctx, *grads) -> tuple:
    """A registered op's backward result: the given gradients of its leading inputs, None for every other input
    (their number recorded by ``setup_context`` as ``ctx.n_inputs``), so that no backward pads by hand."""
    return grads + (None,) * (ctx.n_inputs - len(grads))


def setup_saving_gradient_output(ctx, inputs, output) -> None:
    """``setup_context`` of the ops whose third output is the gradient their forward made (the logits fast path's
    d logits, the token stage's d loss / d logp): it is saved for the backward, it and the sums are not
    differentiable."""
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(output[2])
    ctx.mark_non_differentiable(output[1], output[2])
