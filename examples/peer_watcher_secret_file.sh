#!/usr/bin/env bash
# docs/howto/survive-a-dead-rank.md, "Setting the secret": the watcher's secret in a file in $HOME (which every node
# sees), named by TORCH_PEER_WATCHER_SECRET_FILE, kept out of the environment; then, as a job would, the ranks:
# here 2 of examples/peer_watcher_minimal.py on this host. From the repository root (ALL_REDUCES=N ends them).
set -euo pipefail
umask 077; python3 -c 'import secrets; print(secrets.token_hex(32))' > "$HOME/.torch_peer_watcher_secret"
export TORCH_PEER_WATCHER_SECRET_FILE=$HOME/.torch_peer_watcher_secret
export MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29500} WORLD_SIZE=2
RANK=1 python3 examples/peer_watcher_minimal.py &
RANK=0 python3 examples/peer_watcher_minimal.py
wait $!
