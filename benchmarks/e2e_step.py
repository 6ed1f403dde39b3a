"""End-to-end GRPO step on a GPU: TRL's GRPOTrainer (stock), TRL with ``grpo_kernels.patch_trl()``, and
``grpo.train``, on the same randomly initialised Qwen2.5-0.5B-shaped model, batch and lengths.

    python -m benchmarks.e2e_step --out DIR [--completion-length 384] [--steps 3] [--timeout-s 240]

Model: ``Qwen2Config`` with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate
4864, vocabulary 151936, tied embeddings), random weights, fp32 master weights under bf16 autocast; a byte-level
BPE tokenizer filled up to the whole vocabulary; built locally (no download). Batch: ``--prompts`` prompts x G = 8
completions of ``--completion-length`` tokens (a random model rarely stops, so nearly all reach the limit), one
optimizer step per rollout, dapo loss, beta 0, AdamW. A step is everything a training step costs (generation,
rewards, loss forward/backward, optimizer). Each variant runs in its own process (clean peak-memory counters, no
patch leaking between variants); the first step is warm-up, the median of the others is reported with the peak
allocated GPU memory. Writes ``DIR/e2e_step.json`` and ``DIR/e2e_step.md``. Without CUDA, or without trl for the
TRL variants, the variant is reported as skipped with the reason (exit status 0); a variant that fails or runs
past ``--timeout-s`` is reported the same way. Not collected by pytest. ``--shape tiny --device cpu`` runs the
same code paths on a tiny model, as a smoke check on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("trl", "trl_patched", "grpo_train")
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)


def length_reward(prompts, completions, **kwargs):
    """A cheap reward that varies inside a group (shorter is better), so advantages are not all zero."""
    return [-len(c) / 1000.0 for c in completions]


# --shape tiny: the same code paths on a model small enough for a CPU smoke run.
TINY = dict(QWEN25_05B, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)


def build_model_dir(path: str, shape: dict, seed: int = 0) -> None:
    """Random Qwen2 of ``shape`` and a byte-level BPE tokenizer (the kind Qwen2's tokenizer class loads) whose
    vocabulary is filled up to the model's size, saved as a regular checkpoint directory."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    while len(vocab) < shape["vocab_size"]:
        vocab[f"w{len(vocab)}"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(seed)
    config = Qwen2Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def prompts(n: int, length: int = 32) -> list[dict]:
    """``n`` prompts of ``length`` characters (one token each)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [{"prompt": "".join(letters[(7 * i + 3 * j) % 26] for j in range(length)), "answer": "0"}
            for i in range(n)]


def run_variant(variant: str, model_dir: str, work: str, a) -> dict:
    """One variant in this process: {'step_s': [...], 'peak_gib': float}."""
    import torch

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    steps = a.steps
    if variant == "grpo_train":
        from grpo import TrainConfig
        from grpo.train import train
        from grpo_kernels import GRPOLossConfig

        data = os.path.join(work, "prompts.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in prompts(a.prompts * steps))
        cfg = TrainConfig(model=model_dir, dataset=data, output_dir=os.path.join(work, variant), overwrite=True,
                          max_steps=steps, progress=False, save_steps=0, eval_size=0, device=a.device,
                          prompts_per_step=a.prompts, num_generations=a.G, max_new_tokens=a.completion_length,
                          lr=1e-6, warmup_steps=0, chat_template="off",
                          rewards=("benchmarks.e2e_step:length_reward",), loss=GRPOLossConfig(beta=0.0))
        elapsed = [0.0] + [r["elapsed_s"] for r in train(cfg)["history"]]
        step_s = [b - a_ for a_, b in zip(elapsed, elapsed[1:])]
    else:
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        import grpo_kernels

        if variant == "trl_patched":
            grpo_kernels.patch_trl()

        class Clock(TrainerCallback):
            times = [time.perf_counter()]

            def on_step_end(self, *args, **kwargs):
                if cuda:
                    torch.cuda.synchronize()
                self.times.append(time.perf_counter())

        clock = Clock()
        dataset = Dataset.from_dict({"prompt": [r["prompt"] for r in prompts(a.prompts * steps)]})
        args = GRPOConfig(output_dir=os.path.join(work, variant), per_device_train_batch_size=a.prompts * a.G,
                          num_generations=a.G, max_completion_length=a.completion_length, max_steps=steps,
                          learning_rate=1e-6, beta=0.0, loss_type="dapo", bf16=cuda, use_cpu=not cuda,
                          logging_steps=1,
                          report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
                          model_init_kwargs={"dtype": torch.float32})
        trainer = GRPOTrainer(model=model_dir, reward_funcs=[length_reward], args=args, train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[clock])
        clock.times[:] = [time.perf_counter()]
        trainer.train()
        step_s = [b - a_ for a_, b in zip(clock.times, clock.times[1:])]
    return {"step_s": step_s, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")}


def skip_reason(variant: str, device: str) -> str | None:
    import importlib.util

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA GPU"
    if variant != "grpo_train" and importlib.util.find_spec("trl") is None:
        return "trl is not installed"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for e2e_step.json and e2e_step.md")
    p.add_argument("--completion-length", type=int, default=384)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (x G completions)")
    p.add_argument("-G", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per variant (the first is warm-up)")
    p.add_argument("--timeout-s", type=int, default=240, help="per variant")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one variant, JSON on stdout
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--shape", choices=("qwen2.5-0.5b", "tiny"), default="qwen2.5-0.5b",
                   help="tiny: a smoke run of the same code paths")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke runs only")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.variant:
        print("E2E_RESULT " + json.dumps(run_variant(a.variant, a.model_dir, a.out, a)), flush=True)
        return 0
    results = {}
    shape = QWEN25_05B if a.shape == "qwen2.5-0.5b" else TINY
    model_dir = os.path.join(a.out, f"model_{a.shape}")
    for variant in VARIANTS:
        reason = skip_reason(variant, a.device)
        if reason is None and not os.path.isdir(model_dir):
            build_model_dir(model_dir, shape)
        if reason is not None:
            results[variant] = {"skipped": reason}
            continue
        cmd = [sys.executable, "-m", "benchmarks.e2e_step", "--variant", variant, "--model-dir", model_dir,
               "--out", a.out, "--completion-length", str(a.completion_length), "--prompts", str(a.prompts),
               "-G", str(a.G), "--steps", str(a.steps), "--shape", a.shape, "--device", a.device]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s)
        except subprocess.TimeoutExpired:
            results[variant] = {"skipped": f"timed out after {a.timeout_s} s"}
            continue
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("E2E_RESULT ")), None)
        if proc.returncode != 0 or line is None:
            results[variant] = {"skipped": f"failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"}
            continue
        r = json.loads(line.split(" ", 1)[1])
        timed = r["step_s"][1:] or r["step_s"]
        results[variant] = {"step_s": statistics.median(timed), "steps": r["step_s"], "peak_gib": r["peak_gib"]}
    setup = {"model": f"{a.shape}-shaped Qwen2, random init", "vocab": shape["vocab_size"], "G": a.G,
             "prompts": a.prompts, "completion_length": a.completion_length, "steps": a.steps}
    with open(os.path.join(a.out, "e2e_step.json"), "w") as f:
        json.dump({"setup": setup, "results": results}, f, indent=2)
    precision = "bf16 autocast" if a.device == "cuda" else "fp32 (CPU smoke run)"
    lines = [f"{setup['model']}, V={setup['vocab']}, {a.prompts} prompts x G={a.G}, {a.completion_length} "
             f"completion tokens, {precision}", "", "| variant | step (s) | peak memory (GiB) |", "|---|---|---|"]
    for variant, r in results.items():
        lines.append(f"| {variant} | skipped: {r['skipped']} | |" if "skipped" in r
                     else f"| {variant} | {r['step_s']:.3f} | {r['peak_gib']:.2f} |")
    with open(os.path.join(a.out, "e2e_step.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
