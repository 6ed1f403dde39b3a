"""Code written for Liger-Kernel's GRPO loss runs on grpo_kernels after one changed import: the training step
below uses Liger's ``LigerFusedLinearGRPOLoss`` (constructor, positional forward, ``(loss, (kl, clip_ratio))``)
and ``triton_grpo_loss`` ((B, L + 1, V) logits, per-token outputs) exactly as Liger documents them. With
liger-kernel installed it also prints Liger's own loss on the first batch. CPU (chunked PyTorch) or CUDA (Triton).

    python examples/liger_switch.py        # EXAMPLE_STEPS=2 for a smoke run
"""
import os

import torch

# from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss           # before
# from liger_kernel.transformers.grpo_loss import triton_grpo_loss         # before
from grpo_kernels.liger import LigerFusedLinearGRPOLoss, triton_grpo_loss  # after: nothing else changes

steps = int(os.environ.get("EXAMPLE_STEPS", "20"))
device = "cuda" if torch.cuda.is_available() else "cpu"
B, L, V, H = 8, 12, 64, 32
torch.manual_seed(0)
body = torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Tanh()).to(device)
lm_head = torch.nn.Linear(H, V, bias=False).to(device)
grpo = LigerFusedLinearGRPOLoss(beta=0.04, loss_type="dapo", temperature=1.0)  # Liger's arguments and defaults
opt = torch.optim.AdamW([*body.parameters(), *lm_head.parameters()], lr=1e-2)
ids = torch.randint(0, V, (B, L + 1), device=device)                 # prompt token + L completion tokens
mask = (torch.arange(L, device=device) < torch.randint(4, L + 1, (B, 1), device=device)).long()
with torch.no_grad():
    old = ref = torch.log_softmax(lm_head(body(ids[:, :-1])), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
for step in range(steps):
    advantages = torch.randn(B, device=device)
    loss, (kl, clip_ratio) = grpo(body(ids[:, :-1]), lm_head.weight, ids[:, 1:], mask, advantages, None, ref, old)
    logits = lm_head(body(ids))                                      # (B, L + 1, V): the last position is unused
    per_token_loss, per_token_kl, is_clipped = triton_grpo_loss(logits, old, ref, ids[:, 1:].contiguous(),
                                                                advantages, mask, temperature=1.0)
    loss = loss + (per_token_loss * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 5 == 0 or step == steps - 1:
        print(f"step {step:2d}  loss {loss.item():+.4f}  kl {kl.item():.5f}  clip_ratio {clip_ratio.item():.3f}")
try:  # the same first step on Liger's own module, when liger-kernel is installed
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss as Liger
    torch.manual_seed(0)
    args = (torch.randn(B, L, H, device=device), torch.randn(V, H, device=device) / 4, ids[:, 1:], mask,
            torch.randn(B, device=device), None, ref, old)
    theirs, ours = Liger(compiled=False)(*args)[0].item(), grpo(*args)[0].item()
    print(f"liger-kernel's own module: loss {theirs:+.6f}, grpo_kernels.liger: loss {ours:+.6f}")
except ImportError:
    print("liger-kernel not installed: nothing to compare with")
