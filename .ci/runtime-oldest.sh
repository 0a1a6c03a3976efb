#!/usr/bin/env bash
# The runtime packages' tests on the oldest PyTorch they promise (issue 72): torch-peer-watcher
# ("pytorch >=2.6"), the acceptance suite and the examples, on gloo, with the torch 2.6.0 venv that
# .ci/torch-mpi-backend.sh keeps in the cache (its PyPI CUDA build; gloo needs no GPU). The README's
# run covers the current release; only the modules whose outcome depends on the torch version run
# here: the ones that start torch.distributed jobs. Their tests that need the channelsmith tool are
# left out (the 2.6.0 venv holds torch, not the tool).
#
#   bash .ci/runtime-oldest.sh PYTHON     PYTHON: a python whose torch is 2.6.0
#                                         (.ci/run passes $TORCH_MPI_BACKEND_PYTHON)
set -euo pipefail

cd "$(dirname "$0")/.."

if [ "$#" -ne 1 ] || [ ! -x "$1" ]; then
    echo "usage: bash .ci/runtime-oldest.sh PYTHON (a python with torch 2.6.0: eval \"\$(bash .ci/torch-mpi-backend.sh)\" exports TORCH_MPI_BACKEND_PYTHON)" >&2
    exit 2
fi
python="$1"
version="$("$python" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])')"
if [ "$version" != "2.6.0" ]; then
    echo "runtime-oldest: $python has torch $version, not 2.6.0" >&2
    exit 2
fi

# What pytest and the test modules import beside torch and numpy (the venv's own pip; once).
if ! "$python" -c 'import pytest, xdist, pytest_timeout, yaml' 2>/dev/null; then
    "$python" -m pip install -q --progress-bar off "pytest>=8" "pytest-xdist>=3.6,<4" "pytest-timeout>=2.3,<3" pyyaml
fi

# The packages under test come from the checkout, as the default run's editable install gives them.
export PYTHONPATH="${PWD}/scripts${PYTHONPATH:+:${PYTHONPATH}}"
modules=(
    tests/test_peer_watcher.py
    tests/test_peer_watcher_gloo.py
    tests/test_peer_watcher_backends.py
    tests/test_peer_watcher_shrink.py
    tests/test_dist_check_run.py
    tests/test_dist_check_plugins.py
    tests/test_dist_check_hsdp.py
    tests/test_dist_check_train.py
    tests/test_examples.py
)
# test_examples: the examples that run ranks (on gloo here); its docs checks do not depend on torch.
"$python" -m pytest -p no:cacheprovider -q "${modules[@]}" \
    -k "not every_example and not excerpt and not the_count and not drifts and not update_rewrites and not readme_states and not quick_start and not condarc and not conda_forge and not every_example_that_needs"
