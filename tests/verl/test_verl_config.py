"""The documented way in: examples/verl_grpo.sh's overrides through verl 0.9.1's own config and loader.

In a fresh interpreter (nothing of grpo_kernels.verl loaded yet), as verl's trainer and worker do it: Hydra composes
verl's ``ppo_trainer`` (FSDP) and ``ppo_megatron_trainer`` configs with the example's overrides (an unknown key or a
bad value fails there); ``omega_conf_to_dataclass`` builds the worker's ``HFModelConfig``, whose ``__post_init__``
imports ``external_lib`` (``grpo_kernels.verl``, which patches verl); the FSDP engine's
``patch_forward_with_backends`` installs the Triton-backend forward the config asks for on a tiny Qwen2 saved here,
and the model's forward then returns exactly what ``grpo_kernels.verl.linear_cross_entropy`` gives on its hidden
states (the same call on the same tensors: bitwise). Also verl's other loader, ``VERL_USE_EXTERNAL_MODULES``.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from ..support.ranks import REPO
from ..support.verl_env import require_verl

require_verl()

EXAMPLE = REPO / "examples" / "verl_grpo.sh"

PROBE = r"""
import json, os, sys
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
import verl
from verl.utils.config import omega_conf_to_dataclass

model_dir, overrides = sys.argv[1], json.loads(sys.argv[2])
torch.manual_seed(0)
Qwen2ForCausalLM(Qwen2Config(vocab_size=1003, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
                 ).save_pretrained(model_dir)
out = {"loaded_before": "grpo_kernels.verl" in sys.modules}
config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
with initialize_config_dir(config_dir=config_dir, version_base=None):
    configs = {name: compose(config_name=name, overrides=overrides) for name in ("ppo_trainer", "ppo_megatron_trainer")}
model_config = configs["ppo_trainer"].actor_rollout_ref.model
out["megatron_external_lib"] = configs["ppo_megatron_trainer"].actor_rollout_ref.model.external_lib
hf = omega_conf_to_dataclass(model_config)  # the worker's HFModelConfig: imports external_lib
import verl.utils.kernel.linear_cross_entropy as seam
import grpo_kernels.verl as gk_verl
out["patched"] = seam.linear_cross_entropy is gk_verl.linear_cross_entropy
out["report"] = str(gk_verl.REPORT)

from verl.models.transformers.monkey_patch import patch_forward_with_backends
model = AutoModelForCausalLM.from_pretrained(hf.local_path, attn_implementation="sdpa")
patch_forward_with_backends(model, use_fused_kernels=hf.use_fused_kernels,
                            fused_kernels_backend=hf.fused_kernel_options["impl_backend"])
ids = torch.randint(0, 1003, (1, 9), generator=torch.Generator().manual_seed(0))
positions = torch.cat([torch.arange(4), torch.arange(5)]).unsqueeze(0)
labels = torch.roll(ids, -1, -1)
with torch.no_grad():
    got = model(input_ids=ids, position_ids=positions, shift_labels=labels, temperature=1.0, return_dict=True)
    hidden = model.model(input_ids=ids, position_ids=positions)[0]
    expected = gk_verl.linear_cross_entropy(hidden, model.lm_head.weight, labels, 1.0, "none")
out["forward"] = type(model).forward.__module__ + "." + type(model).forward.__name__
out["same"] = bool(torch.equal(got.log_probs, expected[0]) and torch.equal(got.entropy, expected[1]))
out["shape"] = list(got.log_probs.shape)
print("RESULT " + json.dumps(out))
"""


def example_overrides(model_dir) -> list[str]:
    """The Hydra overrides of examples/verl_grpo.sh's command, its variables set (the model: a local directory)."""
    text = EXAMPLE.read_text()
    command = text[text.index("python3 -m verl.trainer.main_ppo"):].replace("\\\n", " ")
    command = command.replace('"$MODEL"', str(model_dir)).replace("$DATA", "/data/gsm8k").replace('"$@"', "")
    words = shlex.split(command)
    assert words[3:5] == ["--config-name", "$CONFIG"], words[:6]
    return words[5:]


def _run(code, *args, env=None):
    run = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, **(env or {})})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[-1][len("RESULT "):])


def test_example_overrides_load_grpo_kernels_through_verls_config(tmp_path):
    overrides = example_overrides(tmp_path / "tiny_qwen2")
    assert {"actor_rollout_ref.model.external_lib=grpo_kernels.verl", "actor_rollout_ref.model.use_fused_kernels=True",
            "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"} <= set(overrides)
    # the tiny model has no tokenizer: the worker's config is told not to load one
    no_tokenizer = ["+actor_rollout_ref.model.load_tokenizer=False"]
    out = _run(PROBE, str(tmp_path / "tiny_qwen2"), json.dumps(overrides + no_tokenizer))
    assert out["loaded_before"] is False and out["patched"] is True, out
    assert out["megatron_external_lib"] == "grpo_kernels.verl"
    assert out["forward"] == "verl.models.transformers.dense_common.forward_with_triton_backend", out
    assert out["same"] is True and out["shape"] == [9], out
    assert "grpo_kernels.verl: verl 0.9.1 patched; swapped: verl.utils.kernel.linear_cross_entropy" in out["report"]


def test_verl_use_external_modules_loads_it_too():
    """``VERL_USE_EXTERNAL_MODULES=grpo_kernels.verl``: ``import verl`` itself imports it (in every process that
    imports verl and inherits the environment)."""
    code = ("import verl, sys; import verl.utils.kernel.linear_cross_entropy as seam; "
            "import json; print('RESULT ' + json.dumps({'patched': seam.linear_cross_entropy.__module__}))")
    out = _run(code, env={"VERL_USE_EXTERNAL_MODULES": "grpo_kernels.verl"})
    assert out["patched"] == "grpo_kernels.integrations.verl", out
