"""``grpo.train --fsdp`` (FSDP2 ``fully_shard``) on CPU with gloo, launched from pytest with time limits.

- Equivalence (tests/train/fsdp_worker.py under torchrun): a fixed synthetic rollout, three optimizer steps on 2 ranks
  (each rank half of the rows) give the parameters of one process on all rows (the three-way rule against the same
  run in float64: the 2-rank run within K times the 1-process run's error plus ATOL), for three loss normalizations
  (grpo: per sequence, dapo: global token count, bnpo: per micro-batch token count) with beta != 0, AdamW and
  clipped SGD, gradients reduce-scattered every micro-batch or once per step (--fsdp-grad-sync); two
  deliberately broken gradient reductions must fail the same comparison.
- A 1-rank FSDP run of grpo.train matches the plain run; its checkpoints are sharded (torch.distributed.checkpoint)
  plus a full ``model/``; resuming reproduces the uninterrupted run; mixing --fsdp and non-FSDP checkpoints is
  refused with a clear error.
- (slow) torchrun with two ranks: save, resume, identical metrics; the 2-rank checkpoint resumed on 1 rank (DCP
  reshards); bf16 mixed precision on 2 ranks against 1 rank.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from grpo import TrainConfig, train
from grpo.cli import config_from_argv
from grpo.errors import UsageError

from ..support.tolerances import assert_errors_three_way, assert_three_way, grad_scale
from ..support.train_runs import (FSDP_FLAGS, SMALL, assert_bf16_numerics_agree, assert_matches_float64_truth, checksum_slack,
                                  fsdp_worker, model_checksum, read_metrics, run_cmd, save_tiny_chat_checkpoint)

OPTS = dict(prompts_per_step=4, num_generations=4, max_steps=4, save_steps=2, loss=TrainConfig().loss,
            mini_batch_size=8, micro_batch_size=4, eval_every=2, eval_size=8, progress=False, seed=3)
FLAGS = FSDP_FLAGS
# Not a tolerance: a broken reduction moves parameters off by the size of an update. AdamW (lr 1e-2) moves every
# parameter with a nonzero gradient by about lr per step, SGD (lr 0.5) by 0.5 |g|; three steps of a wrong gradient
# leave some parameter at least one lr away (measured >= 3e-2), while a correct 2-rank run is within rounding.
BROKEN_MIN_DIFF = 1e-2


# ------------------------------------------------------------------------------------------------- equivalence
def test_two_ranks_match_one_process_and_broken_reductions_do_not(tmp_path):
    results, _ = fsdp_worker(tmp_path, 2)
    assert set(results) == {"grpo-adamw", "grpo-adamw-reshard-reset", "dapo-adamw", "dapo-adamw-step-sync", "bnpo-sgd-clipped",
                            "grpo-sgd-summed", "dapo-adamw-unreduced"}
    for name, r in results.items():
        assert r["world_size"] == 2 and r["resharded_after_gathered"], (name, r)
        if r["expect_match"]:
            assert r["max_param_change"] >= 3 * BROKEN_MIN_DIFF, (name, r)  # the steps did move the parameters
            assert_matches_float64_truth(r, torch.float32, name)
        else:  # the broken runs did step (an update, not a skipped one), just with the wrong gradient
            assert r["max_param_diff"] >= BROKEN_MIN_DIFF, (name, r)
            assert r["max_param_change_sharded"] >= BROKEN_MIN_DIFF, (name, r)  # measured >= 3e-2
    assert results["bnpo-sgd-clipped"]["grad_norms_single"][0] > 1.0  # so clipping to 1.0 was active
    # torch < 2.12's path of gathered() (forced here) also recovers from a layer failing mid-forward inside it
    assert results["grpo-adamw-reshard-reset"]["aborted_inside_gathered"], results["grpo-adamw-reshard-reset"]


def test_decoding_runs_in_lockstep_when_one_rank_finishes_first(tmp_path):
    """2 ranks sample with the sharded model; one rank's rows all end at the first step, the other's never. The
    finished rank keeps joining the layers' all-gathers (pad tokens) until the other is done, instead of leaving it
    blocked (a 20 s gloo timeout); each rank's completions and random stream equal the unsharded model's."""
    out = tmp_path / "decode"
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    os.path.join("tests", "train", "fsdp_decode_worker.py"), "--out", str(out), "--timeout-s", "20"],
                   timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"decode.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["sampled"]["steps"] for r in ranks] == [1, 8] and [r["greedy"]["steps"] for r in ranks] == [8, 1]
    for r in ranks:
        for case in ("sampled", "greedy"):
            assert r[case]["same_tokens"] and r[case]["same_rng_after"], r


# ------------------------------------------------------------------------------------------------- 1-rank runs
def test_fsdp_flag_is_validated():
    assert config_from_argv(["--fsdp"]).fsdp is True and config_from_argv([]).fsdp is False
    with pytest.raises(UsageError, match="--fsdp is a switch"):
        TrainConfig(fsdp="yes")
    assert config_from_argv(["--fsdp", "--fsdp-grad-sync", "step"]).fsdp_grad_sync == "step"
    with pytest.raises(UsageError, match="--fsdp-grad-sync must be one of micro_batch, step"):
        TrainConfig(fsdp_grad_sync="never")


def test_fsdp_grad_sync_without_fsdp_is_refused(tmp_path, capsys):
    with pytest.raises(UsageError, match="--fsdp-grad-sync step only applies to --fsdp runs: add --fsdp"):
        TrainConfig(fsdp_grad_sync="step")
    assert train.main(SMALL + ["--output-dir", str(tmp_path / "run"), "--fsdp-grad-sync", "step"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo.train: error: --fsdp-grad-sync step only applies to --fsdp runs") and \
        err.count("\n") == 1, err


def test_is_fsdp_is_false_without_fsdp2(monkeypatch):
    """torch < 2.6 has no torch.distributed.fsdp.FSDPModule: plain (DDP / single-process) runs still work, only
    --fsdp is refused."""
    import types

    from grpo import sharding

    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", types.ModuleType("torch.distributed.fsdp"))
    assert sharding.is_fsdp(torch.nn.Linear(2, 2)) is False
    with sharding.gathered(torch.nn.Linear(2, 2)):
        pass
    with pytest.raises(UsageError, match="--fsdp needs torch.distributed.fsdp.fully_shard"):
        sharding._fsdp()


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_nested_no_split_modules_shard_outermost_only(one_rank_group):
    """A listed block class nested inside another: only the outer block becomes an FSDP unit (fully_shard of the
    inner one after the outer fails in the first forward); the sharded model trains like the plain one."""
    from torch import nn

    from grpo import sharding
    from grpo.distributed import DistEnv

    class Block(nn.Module):
        def __init__(self, depth: int):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.inner = Block(depth - 1) if depth > 0 else None

        def forward(self, x):
            x = torch.tanh(self.linear(x))
            return self.inner(x) if self.inner is not None else x

    class LM(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(2), Block(1)])
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = LM()

        def forward(self, x):
            return self.lm(x)

    torch.manual_seed(0)
    root = Root()
    plain, truth = Root(), Root().double()
    plain.load_state_dict(root.state_dict())
    truth.load_state_dict(root.state_dict())
    assert sharding.decoder_layers(root.lm) == list(root.lm.blocks)
    sharding.shard(root, DistEnv(device=torch.device("cpu")), None)
    assert [m for m in root.modules() if sharding.is_fsdp(m)] == [root, root.lm.blocks[0], root.lm.blocks[1]]
    x = torch.randn(5, 4)
    for model, inputs in ((root, x), (plain, x), (truth, x.double())):
        model(inputs).square().sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in root.named_parameters()}
    # three-way: the sharded model's gradients within K times the plain fp32 model's error against float64, plus ATOL
    for (n, p), t in zip(plain.named_parameters(), truth.parameters()):
        assert_three_way(grads[n], p.grad, t.grad, torch.float32, n, scale=grad_scale(t.grad))


def test_single_process_fsdp_matches_plain_run_saves_sharded_and_resumes(tmp_path):
    """A 1-process --fsdp run (a 1-rank mesh) is the plain run, bit for bit (same losses, same parameters; also with
    --gradient-checkpointing): over one rank FSDP2's all-gather and reduce-scatter copy, so the same ops run on the
    same values (exact equality, tests/support/tolerances.py rule 3); its checkpoints hold sharded/ (DCP) and a
    full model/; resuming from step 2 reproduces steps 3-4 exactly."""
    plain = train.train(TrainConfig(output_dir=str(tmp_path / "plain"), **OPTS))
    fsdp = train.train(TrainConfig(output_dir=str(tmp_path / "fsdp"), fsdp=True, **OPTS))
    assert [r["step"] for r in fsdp["history"]] == [1, 2, 3, 4]
    for a, b in zip(plain["history"], fsdp["history"]):
        for key in ("loss", "kl", "grad_norm", "reward_mean"):
            assert b[key] == a[key], (key, a, b)
    assert fsdp["param_checksums"] == plain["param_checksums"]
    checkpointed = train.train(TrainConfig(output_dir=str(tmp_path / "gc"), fsdp=True, gradient_checkpointing=True,
                                           **dict(OPTS, save_steps=0)))  # recomputation inside FSDP units
    assert len(checkpointed["history"]) == 4
    for a, b in zip(plain["history"], checkpointed["history"]):  # recomputation repeats the same forward ops
        assert b["loss"] == a["loss"], (a, b)
    ck = tmp_path / "fsdp" / "checkpoint-2"
    assert sorted(os.listdir(ck / "sharded")) == [".metadata", "__0_0.distcp"]
    assert (ck / "COMPLETE").exists() and (ck / "model" / "config.json").exists()
    state = torch.load(ck / "trainer_state.pt", weights_only=False)
    assert state["sharded"] is True and "optimizer" not in state and state["step"] == 2
    final = tmp_path / "fsdp" / "checkpoint-4" / "model"
    # the same values summed in another grouping (per saved tensor vs per FSDP parameter): checksum_slack
    assert abs(model_checksum(final) - fsdp["param_checksums"][0]) <= checksum_slack(final)

    part = tmp_path / "part"
    shutil.copytree(ck, part / "checkpoint-2")
    resumed = train.train(TrainConfig(output_dir=str(part), fsdp=True, resume="latest", **OPTS))
    assert [r["step"] for r in resumed["history"]] == [3, 4]
    for a, b in zip(fsdp["history"][2:], resumed["history"]):
        for key in ("loss", "kl", "grad_norm", "reward_mean", "rollout"):
            assert a[key] == b[key], (key, a, b)
    assert resumed["param_checksums"] == fsdp["param_checksums"]

    with pytest.raises(UsageError, match="saved with --fsdp"):
        train.train(TrainConfig(output_dir=str(part), resume=str(ck), **OPTS))
    with pytest.raises(UsageError, match="saved without --fsdp"):
        train.train(TrainConfig(output_dir=str(part), fsdp=True, resume=str(tmp_path / "plain" / "checkpoint-2"),
                                **OPTS))


# ------------------------------------------------------------------------------------------------- torchrun
@pytest.mark.slow
def test_torchrun_fsdp_resume_reproduces_uninterrupted_run(tmp_path):
    """torchrun, 2 gloo ranks, --fsdp: checkpoint at step 2, resume: steps 3-4 identical to the uninterrupted
    run; every rank wrote its shard; model/ holds the full parameters. Then the 2-rank checkpoint resumed by one
    process (DCP reshards model and optimizer onto a 1-rank mesh)."""
    full, part = tmp_path / "full", tmp_path / "part"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "grpo.train", "--fsdp"] + FLAGS
    proc = run_cmd(cmd + ["--output-dir", str(full)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    shutil.copytree(full / "checkpoint-2", part / "checkpoint-2")
    proc = run_cmd(cmd + ["--output-dir", str(part), "--resume"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4] and [r["step"] for r in b] == [3, 4]
    for ra, rb in zip(a[3:], b):
        for key in ("loss", "kl", "grad_norm", "reward_mean", "rollout", "eval/accuracy"):
            assert ra.get(key) == rb.get(key), (key, ra, rb)
    summary, resumed = (json.loads((d / "run_summary.json").read_text()) for d in (full, part))
    assert summary["world_size"] == 2 and summary["param_checksums"] == resumed["param_checksums"]
    # each rank holds other rows (its shard checksum differs), together the full parameters
    shards = summary["shard_checksums"]
    assert len(shards) == 2 and shards[0] != shards[1]
    assert sum(shards) == summary["param_checksums"][0]  # the same sum of the same two numbers
    # the same run under DDP (same per-rank sampling streams, replicated parameters) ends with the same parameters
    ddp = tmp_path / "ddp"
    proc_ddp = run_cmd(cmd[:cmd.index("--fsdp")] + cmd[cmd.index("--fsdp") + 1:] + ["--output-dir", str(ddp)],
                    timeout=300)
    assert proc_ddp.returncode == 0, proc_ddp.stdout[-2000:] + proc_ddp.stderr[-6000:]
    ddp_summary = json.loads((ddp / "run_summary.json").read_text())
    assert ddp_summary["param_checksums"][0] == ddp_summary["param_checksums"][1]
    # bound: not a rounding bound (grpo.train has no float64 run to measure one against): the two runs differ only
    #   in the rounding of their reductions (FSDP's sharded sums of squares for the clip norm, reduce-scatter vs
    #   all-reduce), ~1e-9 relative (7e-10 measured); a different run (another sampling stream, a wrong reduction)
    #   moves the checksum by at least an update: AdamW moves each of the ~2e5 parameters by ~lr = 1e-3 (the
    #   built-in model's default), ~sqrt(2e5) lr ~ 0.4 in a checksum of ~4e2, 1e-3 relative, and the loss by
    #   O(its size). 1e-6 and 1e-4 lie orders of magnitude from both.
    assert summary["param_checksums"][0] == pytest.approx(ddp_summary["param_checksums"][0], rel=1e-6)
    for ra, rd in zip(a[1:], read_metrics(ddp)[1:]):
        assert rd["loss"] == pytest.approx(ra["loss"], rel=1e-4, abs=1e-6), (ra, rd)  # bound: as above
    assert sorted(os.listdir(full / "checkpoint-2" / "sharded")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    final = full / "checkpoint-4" / "model"  # the same values in another grouping: checksum_slack
    assert abs(model_checksum(final) - summary["param_checksums"][0]) <= checksum_slack(final)
    # onto one process: the restored parameters are checkpoint-2's, and training continues from there
    one = tmp_path / "one"
    shutil.copytree(full / "checkpoint-2", one / "checkpoint-2")
    opts = dict(OPTS, loss=OPTS["loss"].replace(beta=0.04))
    restored = train.train(TrainConfig(output_dir=str(one), fsdp=True, resume="latest", **dict(opts, max_steps=2)))
    saved = full / "checkpoint-2" / "model"  # restored = saved values, summed per rank-1 shard: checksum_slack
    assert restored["history"] == [] and \
        abs(restored["param_checksums"][0] - model_checksum(saved)) <= checksum_slack(saved)
    more = train.train(TrainConfig(output_dir=str(one), fsdp=True, resume="latest", **dict(opts, max_steps=3)))
    assert [r["step"] for r in more["history"]] == [3]


@pytest.mark.slow
def test_bf16_mixed_precision_two_ranks_match_one_rank(tmp_path):
    """MixedPrecisionPolicy(bf16 params, fp32 reduction) under CPU autocast: 2 ranks against the float64 unsharded
    run within K times the 1-rank FSDP run's error (same numerics, different reduction), plus ATOL of bf16 (the
    three-way rule); against per-op autocast on fp32 weights (the plain run: other bf16 numerics) they agree to bf16
    rounding only (SGD update and first gradient norm: tests/support/train_runs.py's BF16_NUMERICS)."""
    configs = ["--configs", "grpo-adamw,dapo-adamw,bnpo-sgd-clipped", "--autocast", "bfloat16"]
    two, params2 = fsdp_worker(tmp_path, 2, *configs, name="two")
    one, params1 = fsdp_worker(tmp_path, 1, *configs, name="one")
    for name in two:
        assert_errors_three_way(two[name]["param_err_sharded"], one[name]["param_err_sharded"], torch.bfloat16,
                                f"{name}: 2 vs 1 rank parameters", scale=max(1.0, two[name]["param_scale"]))
        assert_three_way(torch.tensor(two[name]["grad_norms_sharded"]), torch.tensor(one[name]["grad_norms_sharded"]),
                         torch.tensor(two[name]["grad_norms_float64"], dtype=torch.float64), torch.bfloat16,
                         f"{name}: 2 vs 1 rank gradient norms")
    assert_bf16_numerics_agree(two["bnpo-sgd-clipped"], "2 ranks vs autocast")


@pytest.mark.slow
def test_torchrun_fsdp_tied_embeddings_train_and_save_tied(tmp_path):
    """A tied-embedding checkpoint (Qwen2, lm_head.weight is embed_tokens.weight) under --fsdp on 2 ranks: the
    shared parameter is one FSDP parameter of the root group; the saved model/ holds it once (as an unsharded save
    does) and reloads tied, trained, and with the run's full checksum."""
    from grpo.modeling import load_pretrained


    model_dir, data, out = tmp_path / "qwen", tmp_path / "math.jsonl", tmp_path / "run"
    save_tiny_chat_checkpoint(str(model_dir))
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + 3?", "answer": str(a + 3)}) + "\n"
                            for a in range(8)))
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 "-m", "grpo.train", "--fsdp", "--model", str(model_dir), "--dataset", str(data),
                 "--reward", "tests.train.fsdp_worker:completion_length_reward", "--lr", "1e-2", "--warmup-steps", "0",
                 "--max-steps", "2", "--max-new-tokens", "8", "--beta", "0.04", "--output-dir", str(out)] + SMALL,
                timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    summary = json.loads((out / "run_summary.json").read_text())
    before, _ = load_pretrained(str(model_dir), torch.float32, "sdpa")
    after, _ = load_pretrained(str(out / "checkpoint-2" / "model"), torch.float32, "sdpa")
    assert after.config.tie_word_embeddings and after.lm_head.weight is after.model.embed_tokens.weight
    with torch.no_grad():
        # bound: not a tolerance: trained = moved by more than fp32 rounding of weights of size ~0.1 (1e-8), while
        #   two Adam steps at lr 1e-2 move it by ~2e-2
        assert float((after.lm_head.weight - before.lm_head.weight).abs().max()) > 1e-4
        reloaded = sum(float(p.double().sum()) + 1e-3 * float(p.double().abs().sum()) for p in after.parameters())
    # the run's values, summed per reloaded (tied: once) parameter, per saved tensor and per shard: checksum_slack
    saved = out / "checkpoint-2" / "model"
    assert abs(reloaded - summary["param_checksums"][0]) <= checksum_slack(saved)
    assert abs(model_checksum(saved) - summary["param_checksums"][0]) <= checksum_slack(saved)
