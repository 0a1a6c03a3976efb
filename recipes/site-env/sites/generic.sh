# shellcheck shell=sh
# Any other machine: NCCL, gloo, MPI and libfabric keep their own defaults, which suit a cluster
# without vendor-specific fabric settings. Only SITE_ENV_PROFILE=generic is set (by the template),
# so tools such as torch-dist-check can tell which profile is active.
