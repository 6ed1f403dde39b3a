"""``grpo_kernels.fused_linear_grpo_loss`` in a hand-written GRPO loop: the loss takes the final hidden states and
the lm_head weight and never builds the (B, T, V) logits. A toy policy learns to answer each prompt token with
the same token; a frozen copy is the reference model of the KL term. CPU (chunked PyTorch) or CUDA (Triton).

    python examples/fused_loss_loop.py        # EXAMPLE_STEPS=2 for a smoke run
"""
import copy
import os

import torch

import grpo_kernels as gk

steps = int(os.environ.get("EXAMPLE_STEPS", "60"))
device = "cuda" if torch.cuda.is_available() else "cpu"
V, H, T, G, prompts = 16, 32, 8, 8, 8  # vocabulary, hidden size, completion length, group size, prompts per step
torch.manual_seed(0)
body = torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Linear(H, H), torch.nn.Tanh()).to(device)
head = torch.nn.Linear(H, V, bias=False).to(device)  # the lm_head: (V, H) weight
ref_body, ref_head = copy.deepcopy(body), copy.deepcopy(head)  # frozen reference policy
opt = torch.optim.AdamW([*body.parameters(), *head.parameters()], lr=3e-2)

for step in range(steps):
    prompt = torch.randint(0, V, (prompts,), device=device).repeat_interleave(G)  # G completions per prompt
    with torch.no_grad():  # sample T tokens per completion (a toy: every position sees only the prompt token)
        logits = head(body(prompt)).unsqueeze(1).expand(-1, T, -1)
        ids = torch.distributions.Categorical(logits=logits).sample()  # (B, T)
        rewards = (ids == prompt[:, None]).float().mean(1)  # share of tokens equal to the prompt token
        ref_logps = gk.linear_token_logprobs(ref_body(prompt).unsqueeze(1).expand(-1, T, -1), ref_head.weight, ids)
    hidden = body(prompt).unsqueeze(1).expand(-1, T, -1)  # (B, T, H) final hidden states, with grad
    loss, metrics = gk.fused_linear_grpo_loss(hidden, head.weight, ids, gk.group_advantages(rewards, G),
                                              ref_logps=ref_logps, loss_type="dapo", beta=0.04)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 0 or step == steps - 1:
        print(f"step {step:3d}  reward {rewards.mean():.3f}  loss {loss.item():+.4f}  kl {metrics['kl']:.4f}")
