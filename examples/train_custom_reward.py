"""``grpo.train`` from Python with a custom reward: the built-in tiny model learns the built-in copy task (repeat the
letters of the prompt), scored by a reward function defined here. Offline, CPU or GPU.

    python examples/train_custom_reward.py        # EXAMPLE_STEPS=2 for a smoke run
"""
import os
import tempfile

from grpo import TrainConfig
from grpo.train import train


def letters_copied(prompts, completions, answer, **kwargs):
    """A reward gets the prompts, the completions and every dataset column (here ``answer``) as lists; one float
    per completion (None: no score). This one: the share of the answer's letters at the right place."""
    return [sum(a == b for a, b in zip(c, gold)) / max(len(gold), len(c), 1) for c, gold in zip(completions, answer)]


steps = int(os.environ.get("EXAMPLE_STEPS", "150"))
config = TrainConfig(
    output_dir=tempfile.mkdtemp(prefix="grpo_run_"),
    max_steps=steps, warmup_steps=min(10, steps - 1), save_steps=0, progress=False,
    # "module:function"; the script itself is module __main__. Built-in names ("copy", "math"...) mix with it.
    rewards=("__main__:letters_copied",),
    eval_every=max(steps // 3, 1),
)
result = train(config)
print(f"mean reward: first steps {result['summary']['reward_first_steps']:.3f}, "
      f"last steps {result['summary']['reward_last_steps']:.3f}; held-out accuracy by step: "
      + ", ".join(f"{e['step']}: {e['eval/accuracy']:.2f}" for e in result["evals"]))
