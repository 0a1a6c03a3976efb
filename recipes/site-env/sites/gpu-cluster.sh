# shellcheck shell=sh
# A non-Cray GPU cluster whose MPI is an MPICH the site built with CUDA (scripts/build-mpich-cuda.sh).
# Such an MPICH takes CUDA buffers by default (MPIR_CVAR_ENABLE_GPU=1), and its libfabric provider
# (FI_PROVIDER) is the site's choice, so neither is forced here.
#
# MPI_Bcast of device buffers inside a node: MPICH 4.3.2 picks its shared-memory release/gather
# algorithm for them (its GPU selection tree is the host one), which copies 8 KiB at a time through
# host memory: 0.5 GB/s on one H100. Its MPIR algorithms instead send the buffer point to point,
# which moves device memory through GPU IPC: 88-1460 GB/s from 2 MiB to 1 GiB, exact
# (docs/records/2026-11-25-cudampi-one-h100.md, "Why MPICH's CUDA all_reduce and broadcast are slow"). The variable
# is MPICH's (ch4); Cray MPICH does not read it.
site_env_set MPIR_CVAR_BCAST_POSIX_INTRA_ALGORITHM mpir
#
# Device buffers up to MPIR_CVAR_CH4_GPU_COLL_SWAP_BUFFER_SZ (1 MiB by default) are staged through a
# host swap buffer in MPICH's ch4 collectives: MPI_Bcast of 1 MiB took 0.40-0.45 ms between two H100s,
# against 0.09 ms with 0, and 0.25 ms for the same broadcast of host memory. At 0 they move by GPU IPC;
# all_reduce, all_gather and reduce_scatter stayed within their own run-to-run spread (A/B alternated,
# docs/records/2026-11-26-cudampi-two-h100.md, "Two GPUs"). The price: MPICH's own MPI_Allreduce of device buffers (which
# torch-mpi-backend calls only with CUDAMPI_COMPOSED=none) got 4x slower at 512 KiB-1 MiB, where it was
# already 0.5-1 ms a call; unset the variable for a program that relies on that call.
site_env_set MPIR_CVAR_CH4_GPU_COLL_SWAP_BUFFER_SZ 0
