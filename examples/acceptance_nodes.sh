#!/usr/bin/env bash
# docs/howto/verify.md, "Several nodes on one host": the suite over 2 stand-in nodes, each a network namespace of
# this host. As root (sudo bash examples/acceptance_nodes.sh), or a user the kernel lets make user namespaces.
# needs: namespaces
set -euo pipefail
python -m torch_dist_check --nodes 2 --nproc-per-node 4                      # 8 ranks, 2 nodes
python -m torch_dist_check --nodes 2 --backends gloo --checks correctness --quick   # CPU, as CI does
python -m torch_dist_check --nodes 2 --checks peerloss --peerloss-backend gloo \
  --peerloss-cases partition,node-kill,store-lost,lossy-link,brief-cut,heal-stop --peerloss-heartbeat 0.5 --peerloss-heartbeat-timeout 1
