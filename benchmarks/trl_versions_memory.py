"""Traced peak memory of one GRPO policy forward + backward through TRL 1.14's own ``GRPOTrainer._compute_loss``
(hence its ``_get_per_token_logps_and_entropies``), stock and with ``grpo_kernels.patch_trl()``, on CPU.

    bash scripts/trl_version.sh 1.14 -m benchmarks.trl_versions_memory [--out DIR] [--prompt 512] [--completion 512]

Shape: one sequence of ``--prompt`` prompt + ``--completion`` completion tokens, a vocabulary of ``--vocab`` (32000),
a tiny-width Llama (hidden 64, one layer, untied head) so that the head and the loss dominate, fp32, temperature 1,
TRL's default loss with beta 0. Each variant runs TRL's ``_compute_loss(model, inputs)`` and ``backward()`` once to
warm up, then once under the torch profiler's memory events (tests/support/memory_trace.py ``transient_peak``: the
largest number of bytes held at any moment by allocations made during the call, the parameters' gradients left out as
the call's outputs). Variants: TRL stock and patched, each with ``use_liger_kernel`` off (TRL's full-logits path; ours
on the backbone's hidden states) and, on TRL 1.14, on (TRL's chunked ``_ChunkedLogProbFunction``; patched: ours in
its place). Also reported: the loss and the largest difference of the gradients from stock's. Prints a markdown
table; ``--out DIR`` also writes ``DIR/trl_versions_memory.json`` and ``.md``. Runs under TRL 1.12, 1.13 or 1.14
(scripts/trl_version.sh; the ``use_liger_kernel`` rows on 1.14 only). Not collected by pytest.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_trainer(vocab: int, length: int, liger: bool, out: str):
    """TRL's GRPOTrainer on a fresh tiny-width Llama (same seed every time), never trained."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, REPO)
    from tests.support.trl_runs import even_words, word_tokenizer
    from tests.support.trl_versions_env import LIGER_LAYERS_OFF

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=2, num_generations=2, report_to="none",
                      use_cpu=True, disable_tqdm=True, use_liger_kernel=liger,
                      liger_kernel_config=LIGER_LAYERS_OFF if liger else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=LlamaForCausalLM(config), reward_funcs=even_words, args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["w1"] * 2}),
                              processing_class=word_tokenizer())
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which this does not run
    return trainer


def make_inputs(vocab: int, prompt: int, completion: int):
    import torch

    g = torch.Generator().manual_seed(1)
    completion_mask = torch.ones(1, completion, dtype=torch.long)
    return {"prompt_ids": torch.randint(3, vocab, (1, prompt), generator=g),
            "prompt_mask": torch.ones(1, prompt, dtype=torch.long),
            "completion_ids": torch.randint(3, vocab, (1, completion), generator=g),
            "completion_mask": completion_mask, "advantages": torch.tensor([0.7]),
            "num_items_in_batch": completion_mask.sum()}


def measure(trainer, inputs):
    """(traced peak bytes, loss, gradients) of one forward + backward of TRL's _compute_loss."""
    from tests.support.memory_trace import transient_peak

    params = [p for p in trainer.model.parameters() if p.requires_grad]
    result = {}

    def step():
        for p in params:
            p.grad = None
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        result["loss"] = loss.item()
        return [p.grad for p in params]

    step()  # warm-up
    peak = transient_peak(step)
    return peak, result["loss"], [p.grad.clone() for p in params]


def run(args) -> list[dict]:
    import torch
    import trl

    import grpo_kernels

    torch.set_num_threads(min(2, torch.get_num_threads()))
    inputs = make_inputs(args.vocab, args.prompt, args.completion)
    series = ".".join(trl.__version__.split(".")[:2])
    rows, stock_grads = [], {}
    for liger in ((False, True) if series == "1.14" else (False,)):
        for patched in (False, True):
            trainer = build_trainer(args.vocab, args.prompt + args.completion, liger, args.work)
            if patched:
                grpo_kernels.patch_trl()
            try:
                peak, loss, grads = measure(trainer, inputs)
            finally:
                grpo_kernels.unpatch_trl()
            if not patched:
                stock_grads[liger] = grads
            diff = max((g - s).abs().max().item() for g, s in zip(grads, stock_grads[liger]))
            rows.append({"trl": trl.__version__, "use_liger_kernel": liger, "patched": patched, "peak_bytes": peak,
                         "loss": loss, "max_grad_diff_vs_stock": diff})
    for row in rows:
        base = next(r for r in rows if not r["patched"] and not r["use_liger_kernel"])
        row["vs_stock"] = row["peak_bytes"] / base["peak_bytes"]
    return rows


def table(rows, args) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"TRL {rows[0]['trl']} GRPO `_compute_loss` forward + backward, prompt {args.prompt} + completion "
             f"{args.completion} tokens, V = {args.vocab}, hidden 64, fp32, CPU ({datetime.date.today()}, commit "
             f"{commit})", "",
             "| TRL path | grpo_kernels | traced peak (MiB) | vs stock | loss | max abs grad diff vs stock |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        path = "use_liger_kernel=True (chunked)" if r["use_liger_kernel"] else "default (full logits)"
        lines.append(f"| {path} | {'patched' if r['patched'] else 'stock'} | {r['peak_bytes'] / 2**20:.1f} | "
                     f"{r['vs_stock']:.3f}x | {r['loss']:.6f} | {r['max_grad_diff_vs_stock']:.2e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", default=None)
    parser.add_argument("--work", default="/tmp/trl_versions_memory")
    args = parser.parse_args(argv)
    rows = run(args)
    text = table(rows, args)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "trl_versions_memory.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "trl_versions_memory.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
