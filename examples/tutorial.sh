#!/usr/bin/env bash
# docs/tutorial.md: from a fresh checkout to a verified PyTorch on this machine. From the repository root:
#   bash examples/tutorial.sh
# It makes ./.venv (channelsmith), builds the light recipes into ./channel, deploys the generic site profile
# from there into ./env, makes ./torch-env (PyTorch and NumPy from PyPI) unless TORCH_ENV names a virtual
# environment whose python imports both, and runs the acceptance suite with that python on two local ranks
# (gloo; NCCL too where a GPU is visible). Exit 0: every check that ran passed.
set -euo pipefail
bash scripts/setup-venv.sh
. .venv/bin/activate
channelsmith plan site-env
channelsmith build site-env
channelsmith deploy site-env-generic --prefix ./env
torch_env="${TORCH_ENV:-$PWD/torch-env}"
if ! "$torch_env/bin/python" -c "import torch, numpy" 2>/dev/null; then
  python3 -m venv "$torch_env"
  "$torch_env/bin/python" -m pip install -q torch numpy
fi
channelsmith verify --prefix "$torch_env" -- --quick
