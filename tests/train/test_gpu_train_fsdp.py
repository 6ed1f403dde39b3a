"""``grpo.train --fsdp`` on a CUDA GPU: NCCL, bf16 mixed precision, the Triton fused head (skipped elsewhere; the
CPU tests with gloo are tests/train/test_train_fsdp.py). One rank per GPU, at most two ranks.
"""
from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from ..support.train_runs import (assert_bf16_numerics_agree, checksum_slack, fsdp_worker, model_checksum,
                                  read_metrics, run_cmd)
from ..support.train_runs import FSDP_FLAGS as FLAGS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (NCCL + bf16 FSDP2); runs on a GPU machine, e.g. in benchmarks/gpu_check.sh")]


def test_fsdp_bf16_steps_on_cuda_agree_with_unsharded_autocast(tmp_path):
    """The equivalence worker on CUDA under bf16 autocast: FSDP's bf16 parameters (MixedPrecisionPolicy) against
    per-op autocast on fp32 weights agree to bf16 rounding (SGD update and first gradient norm:
    tests/support/train_runs.py's BF16_NUMERICS); the AdamW run moves the parameters and stays finite."""
    nproc = min(2, torch.cuda.device_count())
    results, params = fsdp_worker(tmp_path, nproc, "--device", "cuda", "--autocast", "bfloat16",
                              "--configs", "grpo-adamw,bnpo-sgd-clipped")
    # on torch < 2.12 (the GPU image) gathered() ends on the manual reshard path: every parameter 1/N again
    assert all(r["resharded_after_gathered"] for r in results.values()), results
    assert_bf16_numerics_agree(results["bnpo-sgd-clipped"], "FSDP bf16 vs autocast on CUDA")
    adamw = results["grpo-adamw"]
    # bound: not a tolerance: AdamW at lr 1e-2 moves parameters by ~lr per step, 3 steps
    assert adamw["max_param_change"] > 1e-2 and all(torch.isfinite(t).all() for t in params["grpo-adamw"].values())


def test_grpo_train_fsdp_on_cuda_saves_and_resumes(tmp_path):
    """grpo.train --fsdp on the GPU(s) (bf16 autocast, Triton head): runs, writes sharded/ + model/, resumes."""
    nproc = min(2, torch.cuda.device_count())
    run, part = tmp_path / "run", tmp_path / "part"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "grpo.train", "--fsdp", "--device", "cuda"] + FLAGS
    proc = run_cmd(cmd + ["--output-dir", str(run)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["world_size"] == nproc and len(summary["shard_checksums"]) == nproc
    assert sum(summary["shard_checksums"]) == summary["param_checksums"][0]  # the same sum of the same numbers
    final = run / "checkpoint-4" / "model"  # the same values in another grouping: checksum_slack
    assert abs(model_checksum(final) - summary["param_checksums"][0]) <= checksum_slack(final)
    assert (run / "checkpoint-2" / "sharded" / ".metadata").exists()
    assert (run / "checkpoint-4" / "model" / "model.safetensors").exists()
    assert all(r["loss"] == r["loss"] for r in read_metrics(run)[1:])  # finite (not NaN)
    shutil.copytree(run / "checkpoint-2", part / "checkpoint-2")
    proc = run_cmd(cmd + ["--output-dir", str(part), "--resume"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert [r["step"] for r in read_metrics(part)] == [3, 4]


def test_fsdp_setup_never_holds_a_full_copy_on_the_gpu(tmp_path):
    """--fsdp builds the policy and the reference on the CPU; fully_shard moves one unit at a time to the GPU as
    shards. One process (a 1-rank mesh: the shards are the whole model): after setup the GPU holds the fp32 policy
    P and the bf16 reference P/2; the peak stays below 1.75 P (the fp32 policy and an fp32 deep copy on the GPU
    before sharding would be >= 2 P). 8 layers of hidden size 512, so one unit's transient full copy is small."""
    from grpo import TrainConfig
    from grpo.distributed import cleanup_distributed, init_distributed
    from grpo.trainer import Trainer

    cfg = TrainConfig(output_dir=str(tmp_path / "run"), fsdp=True, device="cuda", hidden_size=512, num_layers=8,
                      num_heads=8, prompts_per_step=2, num_generations=2, max_steps=1, progress=False,
                      loss=TrainConfig().loss.replace(beta=0.04))
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    env = init_distributed("cuda", group_for_one=True)
    try:
        trainer = Trainer(cfg, env)
        peak = torch.cuda.max_memory_allocated() - base
        full = sum(p.numel() * 4 for p in trainer.policy.parameters())  # fp32 bytes (1 rank: shards = whole)
        on_gpu = all(t.device.type == "cuda" for m in (trainer.policy, trainer.ref)
                     for t in list(m.parameters()) + list(m.buffers()))
    finally:
        cleanup_distributed()
    assert on_gpu  # the suppress bias and the rotary buffers too
    assert full > 90e6 and peak < 1.75 * full, (peak, full)
