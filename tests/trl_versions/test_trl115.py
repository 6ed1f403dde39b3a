"""patch_trl on TRL 1.15 (run with scripts/trl_version.sh 1.15): 1.16's seam, whose TRL kernel is Triton only.

TRL 1.16's own tests run here unchanged for the seam itself (CI runs tests/hf/test_hf_trl.py and
tests/hf/test_trl_outputs.py under 1.15 too: GRPO, SFT, DPO and KTO stock against patched, TRL's Triton kernel
under the interpreter being the stock run). This file covers what 1.15 adds: on a CPU without Triton's interpreter
TRL's kernel cannot run at all (no Triton: ``trl.trainer.utils._ChunkedLogProbFunction`` is None; Triton without a
GPU: no driver at the first launch), so stock TRL 1.15 fails to train where patched TRL 1.15 trains, and the calls
patch_trl would hand back to TRL's kernel are served (an empty batch) or refused with a RuntimeError.
"""
import os
import subprocess
import sys

import pytest
import torch

from ..support.trl_runs import save_tiny_lm
from ..support.trl_versions_env import require_series

require_series("1.15")

import trl.trainer.utils as trl_utils  # noqa: E402

from grpo_kernels.integrations.trl import TRLLogProbFunction, patch_trl, unpatch_trl  # noqa: E402

from ..support.ranks import REPO  # noqa: E402
from ..support.trl_runs import head_inputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched_trl")

# One GRPO step on the tiny model in a fresh process: "ok" or the error's type and first line. ``no_triton``: Triton
# cannot be imported (sys.modules["triton"] = None, as on a machine without it; grpo_kernels runs without it on CPU).
RUN = r"""
import sys, warnings
if {no_triton}:
    sys.modules["triton"] = None
sys.path.insert(0, {repo!r})
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
import grpo_kernels
from tests.support.trl_runs import even_words
if {patched}:
    grpo_kernels.patch_trl()
args = GRPOConfig(output_dir={out!r}, per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                  max_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no")
trainer = GRPOTrainer(model={path!r}, reward_funcs=even_words, args=args,
                      processing_class=AutoTokenizer.from_pretrained({path!r}),
                      train_dataset=Dataset.from_dict({{"prompt": ["w1 w2", "w3"] * 2}}))
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    print("ok")
except Exception as exc:
    print("failed:", type(exc).__name__, str(exc).splitlines()[0])
"""
STOCK_FAILURE = {False: "failed: RuntimeError 0 active drivers",
                 True: "failed: AttributeError 'NoneType' object has no attribute 'apply'"}


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("tiny_llama"))[0]


@pytest.mark.parametrize("no_triton", [False, True], ids=["triton-no-gpu", "no-triton"])
@pytest.mark.parametrize("patched", [False, True], ids=["stock", "patched"])
def test_grpo_on_a_cpu_without_the_interpreter(tiny_lm, tmp_path, patched, no_triton):
    """CPU tensors and TRITON_INTERPRET=0, with Triton installed or not: TRL 1.15's GRPOTrainer fails stock (no driver;
    no kernel at all) and trains patched."""
    code = RUN.format(no_triton=no_triton, repo=str(REPO), patched=patched, out=str(tmp_path / "run"), path=tiny_lm)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last == "ok" if patched else last.startswith(STOCK_FAILURE[no_triton]), last


@pytest.fixture
def no_triton(monkeypatch):
    """TRL 1.15 as it loads without Triton: its kernel module fails to import and trl.trainer.utils holds None.
    Unpatched before monkeypatch puts TRL's kernel back (unpatching later would restore the None patch_trl saw)."""
    monkeypatch.setitem(sys.modules, "trl.kernels.chunked_logprob", None)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", None)
    yield
    unpatch_trl()


def test_without_triton_the_report_and_the_stand_in(no_triton):
    report = patch_trl()
    rows = {r.calls: r for r in report.routes}
    assert rows["an empty batch of scored positions"].runs_on == "grpo_kernels"
    assert rows["logit scale / soft cap not finite > 0"].runs_on == "-"
    unpatch_trl()
    assert trl_utils._ChunkedLogProbFunction is None  # restored as TRL had it


def test_without_triton_an_empty_batch_is_served(no_triton):
    """TRL's answer to an empty batch: empty outputs, a zero gradient for hidden, weight and bias (graph kept)."""
    patch_trl()
    h, w, b, ids = head_inputs()
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    logp, entropy, lssp, mean, top1 = TRLLogProbFunction.apply(h[:0], w, b, ids[:0], 1.0, 16, None, 1.0, outputs)
    assert [t.shape for t in (logp, entropy, lssp, mean, top1)] == [(0,)] * 5 and top1.dtype == torch.bool
    (logp.sum() + entropy.sum()).backward()
    assert all(t.grad is not None and (t.grad == 0).all() for t in (h, w, b))


def test_without_triton_an_unfoldable_head_raises(no_triton):
    patch_trl()
    h, w, b, ids = head_inputs()
    with pytest.warns(UserWarning, match="final_logit_softcapping=-1.0"):
        with pytest.raises(RuntimeError, match="needs Triton on a CUDA or XPU device"):
            TRLLogProbFunction.apply(h, w, b, ids, 1.0, 16, -1.0, 1.0, ("log_probs",))
