"""TRL's GRPOTrainer on grpo_kernels' fused LM head, fully offline: a tiny local Llama with the package's character
tokenizer, a custom dataset and reward, and a KL term to a reference model (beta > 0).

    python examples/trl_grpo.py          # EXAMPLE_STEPS=2 for a smoke run
"""
import os
import tempfile
import warnings

import torch
from datasets import Dataset
from transformers import PrinterCallback
from transformers.utils import logging as hf_logging
from trl import GRPOConfig, GRPOTrainer

import grpo
import grpo_kernels

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices inside TRL
hf_logging.disable_progress_bar()
steps, work = int(os.environ.get("EXAMPLE_STEPS", "40")), tempfile.mkdtemp(prefix="trl_grpo_")

# A random tiny model saved to a folder: with beta > 0 TRL loads the reference model from that path.
tokenizer = grpo.char_tokenizer("abcdefgh ")
torch.manual_seed(0)
grpo.build_tiny_model(tokenizer, hidden_size=32, num_layers=1, initializer_range=0.2).save_pretrained(work)
tokenizer.save_pretrained(work)

# A custom dataset ("prompt" column) and reward: the share of the letter "a" in each completion.
dataset = Dataset.from_dict({"prompt": ["abc", "bcd", "cde", "def", "efg", "fgh"] * 8})


def share_of_a(completions, **kwargs):
    return [c.count("a") / max(len(c), 1) for c in completions]


print(grpo_kernels.patch_trl())  # before building the trainer; the report says what runs on grpo_kernels
args = GRPOConfig(output_dir=os.path.join(work, "run"), per_device_train_batch_size=16, num_generations=8,
                  max_completion_length=8, max_steps=steps, learning_rate=2e-2, beta=0.04, logging_steps=1,
                  use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no", disable_tqdm=True)
trainer = GRPOTrainer(model=work, reward_funcs=share_of_a, args=args, train_dataset=dataset,
                      processing_class=tokenizer)
trainer.remove_callback(PrinterCallback)  # no per-step dicts on stdout
trainer.train()
rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
print(f"mean reward: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}")
grpo_kernels.unpatch_trl()
