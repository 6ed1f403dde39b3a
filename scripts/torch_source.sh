#!/usr/bin/env bash
# Where scripts/setup.sh gets torch from. Prints one line, "<action> <reason>":
#   keep       the pinned torch is already installed (CPU or CUDA build): nothing to download
#   keep-cuda  an NVIDIA driver is present and a CUDA build of torch (any version) is installed: left alone
#   cpu        no NVIDIA driver: the CPU build from PyTorch's CPU wheel index (~190 MB, not the multi-GB CUDA one)
#   default    an NVIDIA driver and no CUDA build of torch: the default index (its Linux wheel is the CUDA build)
# Usage: scripts/torch_source.sh PYTHON [TORCH_VERSION]
# An NVIDIA driver means: `nvidia-smi -L` runs and succeeds (a GPU machine; nvidia-smi without a loaded driver
# fails). Nothing is downloaded here; PYTHON need not have torch.
set -uo pipefail
PY=${1:?usage: torch_source.sh PYTHON [TORCH_VERSION]}
WANT=${2:-2.13.0}
# "<version> <cuda version or none>", empty when PYTHON has no importable torch
installed=$(timeout 120 "$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "none")' 2>/dev/null)
version=${installed%% *}
cuda=${installed##* }
if nvidia-smi -L > /dev/null 2>&1; then
    if [ -n "$installed" ] && [ "$cuda" != "none" ]; then
        echo "keep-cuda NVIDIA driver found; torch $version (CUDA $cuda) already installed, left alone"
    else
        echo "default NVIDIA driver found and ${installed:+torch $version is a CPU build}${installed:-no torch installed}: torch==$WANT from the default index (CUDA build)"
    fi
elif [ -n "$installed" ] && [ "${version%%+*}" = "$WANT" ]; then
    echo "keep torch $version already installed"
else
    echo "cpu no NVIDIA driver${installed:+; torch $version is not $WANT}: torch==$WANT from PyTorch's CPU wheel index"
fi
