#!/usr/bin/env bash
# The same build without channelsmith (docs/reference/recipes.md): a v1 builder takes the recipe with the shared matrix. From
# the repository root: bash examples/build_without_channelsmith.sh rattler-build|conda-build (narrow it to
# one variant combination with --variant, see below). pixi: `pixi build`, with a pixi-build manifest
# pointing at the recipe (pixi reads recipe.yaml).
# needs: conda-forge, rattler-build
set -euo pipefail
case "${1:-}" in
  rattler-build) rattler-build build -r recipes/pytorch-cray-mpich -m conda_build_config.yaml -c conda-forge "${@:2}" ;;
  conda-build) conda build recipes/pytorch-cray-mpich -m conda_build_config.yaml -c conda-forge "${@:2}" ;;  # conda-build >= 26.5
  *) echo "usage: $0 rattler-build|conda-build [the builder's options]" >&2; exit 2 ;;
esac
