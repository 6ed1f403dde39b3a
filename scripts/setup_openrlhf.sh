#!/usr/bin/env bash
# Create .venv-openrlhf (if missing or not as pinned): OpenRLHF 0.11.2, for the tests of grpo_kernels.openrlhf
# (tests/openrlhf/) and benchmarks/openrlhf_memory.py. OpenRLHF pins transformers==5.15.0 and deepspeed==0.19.6 (the
# main .venv has newer ones) and requires flash-attn, which has no CPU build, so it gets its own environment:
#   torch==2.13.0, CPU build (PyTorch's CPU wheel index; if it cannot be reached in 10 s, the default index, where a
#   configured local wheel folder may serve it): first, so that nothing asks for a bare `torch`, which would pull a
#   multi-GB CUDA build;
#   openrlhf==0.11.2 (--no-deps) and the part of its requirements that its model modules (openrlhf.models: actor,
#   loss, model, ring_attn_utils, utils), openrlhf.utils, its PPO actor and DPO trainer modules, its own unit tests
#   and the Ray test import: transformers, deepspeed, peft, accelerate, einops, sympy, pylatexenc, torchdata, ray
#   (without [default]), aiohttp, pillow, with pytest, pinned by scripts/openrlhf-constraints.txt (the set the tests
#   were run with). Left out, as nothing the tests reach imports them: flash-attn (no CPU build; a TEST-ONLY stand-in
#   of the two pure-PyTorch modules OpenRLHF imports at load, tests/openrlhf/stubs/flash_attn, is put on sys.path by
#   tests/openrlhf/conftest.py and never installed), vllm (the PPO step test stands a MagicMock in for
#   openrlhf.trainer.ray.vllm_engine while it imports ppo_actor), bitsandbytes, datasets (two of OpenRLHF's dataset
#   tests need it: not run), wandb, tensorboard, optimum, torchmetrics and ray[default]'s dashboard;
#   triton==3.9.0 (as .venv; --no-deps: the Triton interpreter case; a resolver pass could replace the CPU torch).
# OpenRLHF's wheel also installs a top-level `tests` package (its own unit tests) into site-packages, which would
# shadow this repository's `tests` package for any process that imports `tests` before the checkout is on sys.path.
# This script moves it out of site-packages to $VENV/openrlhf-tests/tests (with a link to the installed openrlhf
# beside it, the layout those tests expect); tests/openrlhf/test_openrlhf_shipped.py runs them from there, patched.
# The package itself is not installed: the tests run from the checkout (python -m pytest puts it first on sys.path).
# Use: .venv-openrlhf/bin/python -m pytest tests/openrlhf -q (docs/openrlhf.md). Idempotent: a second run only
# checks the versions (~20 s; the first run 132 s on 2 cores with pip's cache empty, torch from a local wheel).
# Knobs: OPENRLHF_VENV; PYTHON, TORCH_CPU_INDEX (lib_venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib_venv.sh
VENV=${OPENRLHF_VENV:-.venv-openrlhf}
OPENRLHF_VERSION=0.11.2
TRITON_VERSION=3.9.0
CONSTRAINTS=scripts/openrlhf-constraints.txt
# The check drops the working directory (this checkout) from sys.path so that this checkout's own `tests` package is
# not seen: a `tests` found then is site-packages' (OpenRLHF's, which must have been moved out).
check='import sys, os; sys.path = [p for p in sys.path if p not in ("", os.getcwd())]
import importlib.metadata as md, importlib.util as iu
import torch, triton, transformers, deepspeed, peft, pytest, ray, PIL, aiohttp
v = (torch.__version__.split("+")[0], md.version("openrlhf"), triton.__version__)
shadow = iu.find_spec("tests") is not None and "site-packages" in (iu.find_spec("tests").origin or "")
moved = os.path.isfile(os.path.join(sys.argv[4], "tests", "test_actor_entropy_temperature.py"))
print(*v, "transformers", transformers.__version__, "deepspeed", deepspeed.__version__)
sys.exit(v != tuple(sys.argv[1:4]) or shadow or not moved)'
export DS_ACCELERATOR=cpu DS_BUILD_OPS=0
pins=("$TORCH_VERSION" "$OPENRLHF_VERSION" "$TRITON_VERSION" "$VENV/openrlhf-tests")
if venv_ready "$VENV" "$check" "${pins[@]}"; then
    echo "$VENV ready: torch $TORCH_VERSION openrlhf $OPENRLHF_VERSION triton $TRITON_VERSION (cached)"
    exit 0
fi
torch_venv "$VENV" "$TORCH_VERSION"
$PIP install -q --disable-pip-version-check --no-deps "openrlhf==$OPENRLHF_VERSION"
$PIP install -q --disable-pip-version-check -c "$CONSTRAINTS" transformers deepspeed peft accelerate einops sympy \
    pylatexenc torchdata ray aiohttp pillow numpy packaging pytest > "$VENV/logs/openrlhf.log" 2>&1 \
    || { tail -20 "$VENV/logs/openrlhf.log"; exit 1; }
$PIP install -q --disable-pip-version-check --no-deps "triton==$TRITON_VERSION"
# OpenRLHF's own tests out of site-packages (see above), kept runnable beside a link to the installed package.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$VENV/openrlhf-tests"
if [ -d "$SITE/tests" ]; then
    rm -rf "$VENV/openrlhf-tests/tests"
    mv "$SITE/tests" "$VENV/openrlhf-tests/tests"
fi
ln -sfn "$SITE/openrlhf" "$VENV/openrlhf-tests/openrlhf"
printf '[pytest]\n' > "$VENV/openrlhf-tests/pytest.ini"  # their rootdir: not this checkout's pytest.ini
"$VENV/bin/python" -W ignore -c "$check" "${pins[@]}" > /dev/null
echo "$VENV ready: torch $TORCH_VERSION openrlhf $OPENRLHF_VERSION triton $TRITON_VERSION"
