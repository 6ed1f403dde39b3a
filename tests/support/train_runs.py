"""What the tests of ``grpo.train`` (tests/train/) share: the repository root, the small run flags, subprocess runs
with the repository on PYTHONPATH, reading a run folder, the FSDP2 equivalence worker under torchrun, and a saved
tiny chat checkpoint."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--prompts-per-step", "4", "-G", "4", "--no-progress"]
# the FSDP2 runs' flags (tests/train/test_train_fsdp.py on gloo, test_gpu_train_fsdp.py on CUDA)
FSDP_FLAGS = SMALL + ["--max-steps", "4", "--save-steps", "2", "--beta", "0.04", "--mini-batch-size", "8",
                      "--micro-batch-size", "4", "--eval-every", "2", "--eval-size", "8", "--seed", "3"]
# The fault tests' runs: a tiny model, 2 prompts x 2 completions, a checkpoint every step (seconds per run).
TINY = ["--prompts-per-step", "2", "-G", "2", "--no-progress", "--hidden-size", "16", "--num-layers", "1",
        "--num-heads", "2", "--eval-size", "0", "--save-steps", "1", "--save-total-limit", "0", "--seed", "3"]
SAME = ("step", "rollout", "loss", "reward_mean", "kl", "grad_norm", "lr")  # equal in a resumed run


def run_env(**extra) -> dict:
    """The environment of a training subprocess: one thread, the repository importable, no Triton interpreter (CPU
    runs take the chunked torch path)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **extra)
    env.pop("TRITON_INTERPRET", None)
    return env


def fault_env() -> dict:
    """The fault tests' subprocess environment: DeepSpeed told there is no accelerator (it prints a warning on stdout
    when it probes for one, and those tests read the processes' output)."""
    return run_env(DS_ACCELERATOR="cpu")


def run_cmd(cmd, timeout=600, cwd=REPO):
    return subprocess.run(cmd, cwd=cwd, env=run_env(), capture_output=True, text=True, timeout=timeout)


def train_tiny(out, steps, *extra):
    """``grpo.train.main`` in this process on the TINY run into ``out`` for ``steps`` steps; its exit code."""
    from grpo import train

    return train.main(TINY + ["--output-dir", str(out), "--max-steps", str(steps)] + list(extra))


def read_metrics(run_dir) -> list[dict]:
    """metrics.jsonl of a run folder, one record per line (the writer never leaves an empty line)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_summary(run_dir) -> dict:
    with open(os.path.join(run_dir, "run_summary.json")) as f:
        return json.load(f)


def snapshot(run_dir) -> dict:
    """Every file of a run folder (but the lock file) with its bytes."""
    from grpo.run_folder import LOCK_FILE

    files = {}
    for root, _, names in os.walk(run_dir):
        for name in names:
            path = os.path.join(root, name)
            if name != LOCK_FILE:
                with open(path, "rb") as f:
                    files[os.path.relpath(path, run_dir)] = f.read()
    return files


def one_error_line(err: str, start: str = "grpo.train: error: ") -> str:
    """The single ``grpo.train: error`` line of a process's stderr (and no traceback)."""
    lines = [line for line in err.splitlines() if line.startswith("grpo.train: error")]
    assert len(lines) == 1 and lines[0].startswith(start) and "Traceback" not in err, err
    return lines[0]


def fsdp_worker(tmp_path, nproc: int, *args: str, name: str = "eq") -> tuple[dict, dict]:
    """tests/train/fsdp_worker.py under torchrun on ``nproc`` ranks: (its JSON results, its saved parameters)."""
    import torch

    out = tmp_path / f"{name}.json"
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                    os.path.join("tests", "train", "fsdp_worker.py"), "--out", str(out), *args], timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), torch.load(str(out) + ".params.pt")


def assert_matches_float64_truth(r: dict, dtype, what: str) -> None:
    """The worker's sharded run against its unsharded run (``dtype``: fp32, or bf16 under autocast) by the
    three-way rule, the float64 unsharded run the truth: parameters (relative to max |parameter|, at least 1) and
    the gradient norm of every step."""
    import torch

    from .tolerances import assert_errors_three_way, assert_three_way

    assert_errors_three_way(r["param_err_sharded"], r["param_err_single"], dtype, f"{what} parameters",
                            scale=max(1.0, r["param_scale"]))
    assert_three_way(torch.tensor(r["grad_norms_sharded"]), torch.tensor(r["grad_norms_single"]),
                     torch.tensor(r["grad_norms_float64"], dtype=torch.float64), dtype, f"{what} gradient norms")


# bound: FSDP's bf16 parameters (norms and residual stream in bf16 too) against per-op autocast on fp32 weights are
#   two different bf16 numerics, so neither is the other's middle term: a gradient of the workers' 2-layer model
#   passes ~12 bf16 roundings on its way (embedding; per layer norm, attention, MLP; final norm; head), each of
#   relative error <= u(bf16), so each run's update is within ~12 u of exact and the two within twice that (9.4%).
BF16_NUMERICS = 2 * 12 * 2.0 ** -8


def assert_bf16_numerics_agree(r: dict, what: str) -> None:
    """The worker's sharded bf16 run against its per-op autocast run: the SGD update and the first gradient norm
    within ``BF16_NUMERICS`` of each other, relative to the update's size and the norm."""
    assert r["max_param_diff"] <= BF16_NUMERICS * r["max_param_change"], (what, r)
    a, b = r["grad_norms_sharded"][0], r["grad_norms_single"][0]
    assert abs(a - b) <= BF16_NUMERICS * abs(b), (what, r)


def model_checksum(model_dir) -> float:
    """Trainer.param_checksums' formula over a save_pretrained directory's tensors."""
    from safetensors.torch import load_file

    total = 0.0
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        for t in load_file(f).values():
            total += float(t.double().sum()) + 1e-3 * float(t.double().abs().sum())
    return total


def checksum_slack(model_dir) -> float:
    """How far two checksums (model_checksum's formula) of the *same* parameter values may lie apart when they add
    them in different orders or groupings (per tensor, per shard, per rank, another thread split): each is a float64
    sum of n = (elements + 3 per tensor) terms ``e + 1e-3 |e|``, within gamma(n) * sum |terms| of the exact sum in
    any order (tests/support/tolerances.py), so the two are within twice that."""
    import torch
    from safetensors.torch import load_file

    from .tolerances import gamma

    n, magnitude = 0, 0.0
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        for t in load_file(f).values():
            n += t.numel() + 3
            magnitude += (1 + 1e-3) * float(t.double().abs().sum())
    return 2 * gamma(n, torch.float64) * magnitude


def save_tiny_chat_checkpoint(path):
    """A Qwen2-architecture checkpoint with a byte-level BPE tokenizer, a chat template, tied embeddings and a
    generation_config that would change sampling (top_k=1, repetition penalty) if it leaked into generation."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["What is 2 + 3? The answer is \\boxed{5}. #### 5"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    lm.generation_config.do_sample, lm.generation_config.top_k = True, 1
    lm.generation_config.repetition_penalty = 1.5
    lm.save_pretrained(path)
    tok.save_pretrained(path)
