"""The fused head: GRPO loss and log-probs from hidden states and the lm_head weight, never writing the N x V
logits (docs/kernels.md, "Fused head"). Paths, chosen by ``planner.plan_head``:

- ``fast``: ``head.fast`` / ``head.fast_sequence``, gradients computed in the forward (6NHV, 4NHV frozen);
- ``light``: ``head.light`` (memory-light recompute, 8NHV), ``head.no_grad`` (2NHV) and ``head.torch``;
- ``torch_tiles``: the tiled eager PyTorch path behind ``head.torch``.
"""
