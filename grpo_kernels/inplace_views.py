"""In-place d logits for a sliced view: the gradient lands in the buffer the view was sliced from.

Why: a caller scoring a shifted sequence passes ``logits[:, :-1]`` (ids ``[:, 1:]``), or ``logits[:, -T - 1:-1]``.
Writing d logits into that view in place is not enough: autograd's own backward of the slice then allocates a fresh
zero gradient of the whole (B, T + 1, V) buffer and copies the view's gradient into it, a second B x T x V tensor.
``root_at_base`` replaces such a view by the same view made by one autograd Function from its base (the tensor it
was sliced from), whose backward hands the base's own buffer back as the base's gradient: the d logits the in-place
path wrote into the view's elements, zeros written over the elements outside it. No logits-sized tensor is made.

What is rooted: a view covering a box of its base (each base dimension a range with step 1: any slicing
``base[a:b, c:d, e:f]``, also after a transpose or permute), reached from the base by view operations alone (the
gradient of a chain of views is decided by which elements alias which), with base and view both requiring grad,
in an eager call. Anything else (a step such as ``[:, ::2]``, a reshaped view, torch.compile) is written in place as
given, and autograd's view backward then allocates its gradient as usual (docs/api.md, "In place").
"""
from __future__ import annotations

import torch

# autograd nodes of view operations: their backward only re-indexes the gradient by aliasing
_VIEW_NODES = frozenset({"SliceBackward0", "AsStridedBackward0", "TransposeBackward0", "PermuteBackward0",
                         "ViewBackward0", "AliasBackward0", "TBackward0", "NarrowBackward0"})


def _reaches_base_by_views(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``view``'s autograd history down to ``base`` is view operations only."""
    node = view.grad_fn
    end = base.grad_fn
    while node is not None and type(node).__name__ in _VIEW_NODES:
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
        if end is not None and node is end:
            return True
        if end is None and type(node).__name__ == "AccumulateGrad" and node.variable is base:
            return True
    return False


def box_of(view: torch.Tensor, base: torch.Tensor) -> tuple | None:
    """The slices ``box`` of ``base`` whose elements are exactly ``view``'s (in any order of dimensions: a
    transposed or permuted view matches each of its dimensions to the base dimension of the same stride), or None
    when the view is not such a box (a step, another dtype, an overlap)."""
    if view.dtype != base.dtype or view.numel() == 0:
        return None
    extents = [1] * base.dim()
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            continue
        match = [d for d in range(base.dim()) if base.shape[d] > 1 and base.stride(d) == stride and extents[d] == 1]
        if len(match) != 1:
            return None
        extents[match[0]] = size
    offset = view.storage_offset() - base.storage_offset()
    starts = [0] * base.dim()
    # Why greedy by stride: in a non-overlapping base each dimension's stride exceeds everything the smaller-strided
    # ones reach, so the offset decomposes uniquely (the checks below guard it anyway).
    for d in sorted(range(base.dim()), key=lambda d: -base.stride(d)):
        if base.shape[d] > 1 and base.stride(d) > 0:
            starts[d], offset = divmod(offset, base.stride(d))
    if offset != 0 or any(s + e > n for s, e, n in zip(starts, extents, base.shape)):
        return None
    box = tuple(slice(s, s + e) for s, e in zip(starts, extents))
    return box if base[box].data_ptr() == view.data_ptr() and base[box].numel() == view.numel() else None


class _BaseWindow(torch.autograd.Function):
    """base -> the view (``geometry``: its sizes, strides and storage offset, covering exactly ``box``), whose
    backward returns the base's own buffer: the view's gradient in the box (already there when the in-place path
    wrote it; copied in otherwise), zeros outside it."""

    @staticmethod
    def forward(ctx, base, box, geometry):
        # Why not save_for_backward: the in-place paths overwrite these logits on purpose (a saved tensor's version
        # check would refuse); only the buffer itself is needed
        ctx.buffer, ctx.box, ctx.geometry = base.detach(), box, geometry
        return base.as_strided(*geometry)

    @staticmethod
    def backward(ctx, grad):
        buffer, box = ctx.buffer, ctx.box
        if buffer is None:
            raise RuntimeError("grpo_kernels: in-place d logits were handed back once; a second backward "
                               "(retain_graph=True) needs inplace_backward=False")
        ctx.buffer = None
        window = buffer.as_strided(*ctx.geometry)
        if not _aliases(grad, window):
            window.copy_(grad)
        for d, piece in enumerate(box):
            outside_before = box[:d] + (slice(0, piece.start),)
            outside_after = box[:d] + (slice(piece.stop, buffer.shape[d]),)
            buffer[outside_before].zero_()
            buffer[outside_after].zero_()
        return buffer, None, None


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements in the same order (strides of size-1 dimensions are arbitrary and ignored)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and all(
        size <= 1 or sa == sb for size, sa, sb in zip(a.shape, a.stride(), b.stride()))


def root_at_base(logits: torch.Tensor) -> torch.Tensor:
    """``logits``, or the same view rooted at its base (module docstring) when it is a box view of a base that
    requires grad, reached by views alone, in an eager call with grad enabled."""
    base = logits._base
    if base is None or not (torch.is_grad_enabled() and logits.requires_grad and base.requires_grad):
        return logits
    if torch.compiler.is_compiling() or not _reaches_base_by_views(logits, base):
        return logits
    box = box_of(logits, base)
    if box is None:
        return logits
    return _BaseWindow.apply(base, box, (logits.shape, logits.stride(), logits.storage_offset()))
