# shellcheck shell=sh
# A non-Cray GPU cluster whose MPI is an MPICH the site built with CUDA (scripts/build-mpich-cuda.sh).
# Such an MPICH takes CUDA buffers by default (MPIR_CVAR_ENABLE_GPU=1), and its libfabric provider
# (FI_PROVIDER) is the site's choice, so no runtime setting is forced here: only
# SITE_ENV_PROFILE=gpu-cluster is set (by the template).
