"""FSDP2 equivalence worker, launched by tests/train/test_train_fsdp.py (and tests/train/test_gpu_train_fsdp.py)
under torchrun.

Every rank builds the same tiny Llama and the same fixed synthetic rollout (no sampling). Each rank takes its
contiguous share of the rows and runs ``grpo.update.optimizer_step`` a few times on the FSDP2-sharded policy
(old log-probs from the policy and reference log-probs from the sharded frozen reference, both computed inside
``sharding.gathered``). Rank 0 then repeats the same steps on one unsharded copy over *all* rows with the same
micro-batch size (the same maths: see optimizer_step's normalization), and, for the configurations expected to
match, once more in float64 (the ground truth of the three-way rule: the sharded fp32 run within K times the
unsharded fp32 run's distance to it, plus ATOL). It writes per configuration the parameters' largest errors against
that truth (or, for the broken ones, the largest difference to the unsharded run) and the runs' gradient norms to
``--out`` (JSON), and the sharded runs' final parameters to ``--out``.params.pt (to compare runs on different world
sizes).

Negative controls (``expect_match`` False) break the gradient reduction on purpose: ``summed`` (gradients summed
instead of averaged over ranks, with SGD so that the scale matters) and ``unreduced`` (gradients never reduced:
each rank steps its shard with its slice of its own rows' gradient). Both still move the parameters.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import grpo_kernels as gk
from grpo import sharding
from grpo.distributed import DistEnv
from grpo.modeling import build_char_tokenizer, build_tiny_model, disable_dropout
from grpo.policy import GRPOPolicy
from grpo.rollout import Rollout
from grpo.update import StepOptions, optimizer_step, rollout_logprobs, trim

CONFIGS = [
    {"name": "grpo-adamw", "loss_type": "grpo", "optimizer": "adamw", "broken": None},
    {"name": "dapo-adamw", "loss_type": "dapo", "optimizer": "adamw", "broken": None},
    {"name": "grpo-adamw-reshard-reset", "loss_type": "grpo", "optimizer": "adamw", "broken": None,
     "reset": "reshard"},  # gathered() ends as on torch < 2.12 (no reset_iter_state)
    {"name": "dapo-adamw-step-sync", "loss_type": "dapo", "optimizer": "adamw", "broken": None, "sync": "step"},
    {"name": "bnpo-sgd-clipped", "loss_type": "bnpo", "optimizer": "sgd", "broken": None, "max_grad_norm": 1.0},
    {"name": "grpo-sgd-summed", "loss_type": "grpo", "optimizer": "sgd", "broken": "summed"},
    {"name": "dapo-adamw-unreduced", "loss_type": "dapo", "optimizer": "adamw", "broken": "unreduced",
     "sync": "step"},
]
ROWS, PROMPT, COMPLETION, MICRO, STEPS, BETA = 8, 4, 6, 2, 3, 0.04


def completion_length_reward(prompts, completions, **_) -> list[float]:
    """A reward that varies within every group (for grpo.train runs in tests/train/test_train_fsdp.py: nonzero
    advantages)."""
    return [float(len(c)) for c in completions]


def synthetic_rollout(vocab: int, device: torch.device) -> tuple[Rollout, torch.Tensor]:
    """8 rows: left-padded prompts (1-4 tokens), completions of 1-6 loss tokens, advantages of both signs."""
    g = torch.Generator().manual_seed(1234)
    prompt_ids = torch.randint(4, vocab, (ROWS, PROMPT), generator=g)
    prompt_mask = torch.ones(ROWS, PROMPT, dtype=torch.long)
    for r, pad in enumerate([0, 1, 3, 0, 2, 0, 1, 0]):
        prompt_mask[r, :pad] = 0
        prompt_ids[r, :pad] = 0
    completion_ids = torch.randint(4, vocab, (ROWS, COMPLETION), generator=g)
    lengths = torch.tensor([6, 1, 4, 6, 2, 5, 3, 6])
    completion_mask = torch.arange(COMPLETION)[None, :] < lengths[:, None]
    completion_ids[~completion_mask] = 0
    rollout = Rollout(
        input_ids=torch.cat([prompt_ids, completion_ids], 1).to(device),
        attention_mask=torch.cat([prompt_mask, completion_mask.long()], 1).to(device), prompt_length=PROMPT,
        completion_ids=completion_ids.to(device), completion_mask=completion_mask.to(device),
        rewards=torch.zeros(ROWS, 1), reward_total=torch.zeros(ROWS), truncated=torch.zeros(ROWS, dtype=torch.bool),
        prompts=[""] * ROWS, completions=[""] * ROWS)
    advantages = torch.randn(ROWS, generator=g).to(device)
    return rollout, advantages


def build(tokenizer, cfg: dict, device: torch.device, autocast, dtype=torch.float32):
    torch.manual_seed(0)
    lm = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, initializer_range=0.2)
    lm.config._attn_implementation = "sdpa"
    disable_dropout(lm)
    lm.to(device=device, dtype=dtype).train()
    loss = gk.GRPOLossConfig(loss_type=cfg["loss_type"], beta=BETA, max_completion_length=COMPLETION)
    ref_lm = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, initializer_range=0.2)
    ref_lm.load_state_dict(lm.state_dict())  # the frozen copy of the initial policy
    ref_lm.to(device=device, dtype=dtype).requires_grad_(False).eval()
    if autocast is not None:
        ref_lm.to(autocast)
    compute = autocast or dtype
    # impl "auto": the chunked torch head on CPU, the Triton kernels on CUDA (float64: the torch head everywhere)
    impl = "torch" if dtype == torch.float64 else "auto"
    return GRPOPolicy(lm, loss, impl, compute, autocast), GRPOPolicy(ref_lm, loss, impl, compute, autocast)


def use_local_gradients(root) -> None:
    """The ``unreduced`` control: with gradient sync off, FSDP2 leaves each parameter's full gradient of this
    rank's rows on the unsharded parameter (``.grad``, or ``unsharded_accumulated_grad`` under a reduce dtype) and
    writes no sharded ``.grad``. Hand the optimizer this rank's slice of that *local* gradient as the shard's
    gradient (what a reduce-scatter without the reduction would give), and clear FSDP2's copy for the next step."""
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    state = root._get_fsdp_state()
    for sub in state._state_ctx.all_states:
        groups = getattr(sub, "_fsdp_param_groups", None)
        if groups is None:  # torch <= 2.11: one group per state
            groups = [g for g in [sub._fsdp_param_group] if g is not None]
        for group in groups:
            for fp in group.fsdp_params:
                local = fp.unsharded_accumulated_grad
                if local is None:
                    local = fp._unsharded_param.grad
                fp.unsharded_accumulated_grad = None
                fp._unsharded_param.grad = None
                param = fp.sharded_param
                chunks = torch.chunk(local.to(param.dtype), world, dim=0)
                mine = chunks[rank] if rank < len(chunks) else local.new_zeros((0,) + local.shape[1:])
                param.grad = DTensor.from_local(mine.contiguous(), param.device_mesh, param.placements,
                                                shape=param.shape, stride=param.stride())


def make_optimizer(policy, kind: str):
    params = [p for p in policy.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def resharded(root) -> bool:
    """After ``gathered``: every parameter of ``root`` is a DTensor again holding 1/N of the rows (the
    lm_head included), and no forward call is left on FSDP2's record of them."""
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    params = dict(root.named_parameters())
    ok = isinstance(root.lm.lm_head.weight, DTensor) and len(params) > 0
    for p in params.values():
        ok &= isinstance(p, DTensor) and p.to_local().shape[0] <= -(-p.shape[0] // world) \
            and (world == 1 or p.to_local().numel() < p.numel())
    state = root._get_fsdp_state()
    ok &= len(state._comm_ctx.post_forward_order) == 0
    return bool(ok)


def abort_inside_gathered(policy, rollout) -> bool:
    """A decoder layer raising mid-forward (after FSDP's pre-forward gathered it) inside ``gathered()``: the exit
    must still leave FSDP ready for the training steps that follow (every rank raises at the same point)."""
    layer = sharding.decoder_layers(policy.lm)[0]

    def fail(module, args):
        raise RuntimeError("abort inside gathered()")

    handle = layer.register_forward_pre_hook(fail)
    try:
        with sharding.gathered(policy):
            rollout_logprobs(policy, rollout, MICRO)
    except RuntimeError as error:
        return "abort inside gathered()" in str(error)
    finally:
        handle.remove()
    return False


def logprobs_of(policy, rollout) -> torch.Tensor:
    """``rollout_logprobs`` in the policy's own dtype: grpo.update stores fp32, which would round the float64
    truth run's old / reference log-probs to fp32 (an error of the size the comparison measures)."""
    dtype = next(policy.parameters()).dtype
    if dtype == torch.float32:
        return rollout_logprobs(policy, rollout, MICRO)
    out = torch.zeros(rollout.completion_ids.shape, dtype=dtype, device=rollout.completion_ids.device)
    for rows in torch.arange(rollout.batch_size, device=out.device).split(MICRO):
        batch = trim(rollout.batch(rows))
        out[rows, :batch["completion_ids"].shape[1]] = policy.token_logprobs(batch).to(dtype)
    return out


def run(policy, ref, model, optimizer, rollout, advantages, rows, env, max_grad_norm: float,
        sync: str = "micro_batch", checks: dict | None = None) -> list[float]:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with sharding.gathered(policy):
        old_logps = logprobs_of(policy, rollout)
    with sharding.gathered(ref):
        ref_logps = logprobs_of(ref, rollout)
    if checks is not None:
        checks["resharded_after_gathered"] = resharded(policy) and resharded(ref)
    norms = []
    for _ in range(STEPS):
        stats = optimizer_step(model, policy, optimizer, scheduler, rollout, rows, advantages, old_logps, ref_logps,
                               StepOptions(micro_batch_size=MICRO, max_grad_norm=max_grad_norm, env=env,
                                           fsdp_grad_sync=sync))
        norms.append(stats["grad_norm"])
    return norms


def float64_truth(tokenizer, cfg, device, rollout, advantages, clip, sharded, single_state, single_env) -> dict:
    """The unsharded run in float64, without autocast (the ground truth): the largest parameter error of the sharded
    and of the unsharded run (fp32, or under autocast) against it, the largest |parameter| (the rule's scale), and
    its gradient norms."""
    policy, ref = build(tokenizer, cfg, device, None, torch.float64)
    optimizer = make_optimizer(policy, cfg["optimizer"])
    norms = run(policy, ref, policy, optimizer, rollout, advantages.double(), torch.arange(ROWS, device=device),
                single_env, clip)
    truth = {k: v.detach().cpu() for k, v in policy.lm.state_dict().items()}
    assert all(v.dtype == torch.float64 for v in truth.values() if v.is_floating_point())

    def err(state):
        return max(float((state[k].detach().cpu().double() - truth[k]).abs().max()) for k in truth)
    return {"param_err_sharded": err(sharded), "param_err_single": err(single_state),
            "param_scale": max(float(v.abs().max()) for v in truth.values()), "grad_norms_float64": norms}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", default="none", choices=["none", "bfloat16"])
    parser.add_argument("--configs", default=",".join(c["name"] for c in CONFIGS))
    args = parser.parse_args()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=device)
    single = DistEnv(device=device)
    autocast = torch.bfloat16 if args.autocast == "bfloat16" else None
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer("abcdefgh=")
    results, params = {}, {}
    for cfg in [c for c in CONFIGS if c["name"] in args.configs.split(",")]:
        rollout, advantages = synthetic_rollout(len(tokenizer), device)
        policy, ref = build(tokenizer, cfg, device, autocast)
        sharding.shard(policy, env, autocast)
        sharding.shard(ref, env, autocast)
        if cfg["broken"] == "unreduced":
            policy.set_requires_gradient_sync = lambda sync, recurse=True: \
                type(policy).set_requires_gradient_sync(policy, False, recurse=recurse)
        optimizer = make_optimizer(policy, cfg["optimizer"])
        if cfg["broken"] == "unreduced":  # each rank steps on its shard of its *own* (unreduced) gradient
            optimizer.register_step_pre_hook(lambda opt, *_: use_local_gradients(policy))
        reset = sharding._reset_forward_state
        if cfg.get("reset") == "reshard":
            sharding._reset_forward_state = lambda root: reset(root, use_reset_iter_state=False)
        if cfg["broken"] == "summed":  # what a reduction that sums instead of averaging would hand the optimizer
            def summed(opt, *_):
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.grad.mul_(world)
            optimizer.register_step_pre_hook(summed)
        share = ROWS // world
        rows = torch.arange(rank * share, (rank + 1) * share, device=device)
        clip = cfg.get("max_grad_norm", 0.0)
        checks = {}
        if cfg.get("reset") == "reshard":
            checks["aborted_inside_gathered"] = abort_inside_gathered(policy, rollout)
        sharded_norms = run(policy, ref, policy, optimizer, rollout, advantages, rows, env, clip,
                            cfg.get("sync", "micro_batch"), checks)
        sharding._reset_forward_state = reset
        full = sharding.full_lm_state_dict(policy)
        if rank == 0:
            params[cfg["name"]] = full
            policy1, ref1 = build(tokenizer, cfg, device, autocast)
            optimizer1 = make_optimizer(policy1, cfg["optimizer"])
            norms = run(policy1, ref1, policy1, optimizer1, rollout, advantages,
                        torch.arange(ROWS, device=device), single, clip)
            truth = policy1.lm.state_dict()
            diff = max(float((full[k].float() - truth[k].detach().cpu().float()).abs().max()) for k in truth)
            moved = max(float((truth[k].detach().cpu().float() - v.detach().cpu().float()).abs().max())
                        for k, v in build(tokenizer, cfg, device, autocast)[0].lm.state_dict().items())
            start = build(tokenizer, cfg, device, autocast)[0].lm.state_dict()
            moved_sharded = max(float((full[k].float() - v.detach().cpu().float()).abs().max())
                                for k, v in start.items())
            results[cfg["name"]] = {"max_param_diff": diff, "max_param_change": moved,
                                    "max_param_change_sharded": moved_sharded,
                                    "grad_norms_sharded": sharded_norms, "grad_norms_single": norms,
                                    "expect_match": cfg["broken"] is None, "world_size": world, **checks}
            if cfg["broken"] is None:
                results[cfg["name"]].update(float64_truth(tokenizer, cfg, device, rollout, advantages, clip, full,
                                                          truth, single))
        dist.barrier()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        torch.save(params, args.out + ".params.pt")  # the sharded runs' final full parameters
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
