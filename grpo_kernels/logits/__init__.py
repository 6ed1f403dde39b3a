"""The logits path: GRPO loss and log-probs from given (B, T, V) logits (docs/kernels.md, "Logits path").

- ``logprobs``: the ``logits.sweep`` (Triton) and ``logits.torch`` (chunked PyTorch) log-prob sweeps;
- ``fast``: ``logits.fast``, the loss with its gradient written by the forward kernel.
"""
