# shellcheck shell=sh
# NCAR Derecho: HPE Cray EX, Slingshot 11 (cxi), 4x A100 per node, Cray MPICH.
# From NCAR's Derecho profile (benkirk/derecho-pytorch-mpi profile.d/derecho-nccl-aws-ofi.cfg, after
# HPE's "Running NCCL-Based Applications" v1.1) as updated in benkirk/conda-recipes 5aa7341 (2025-05).
# NCCL_NET="AWS Libfabric" belongs to the NCCL OFI plugin package, not to the site.

# Cray MPICH: pass CUDA buffers straight to MPI, and pick the NIC closest to each rank's GPU.
site_env_set MPICH_GPU_SUPPORT_ENABLED 1
site_env_set MPICH_OFI_NIC_POLICY GPU
# libfabric cxi: userfaultfd keeps the memory-registration cache coherent with CUDA memory;
# skipping host registration and a deep completion queue avoid the cxi errors NCCL runs hit.
site_env_set FI_MR_CACHE_MONITOR userfaultfd
site_env_set FI_CXI_DISABLE_HOST_REGISTER 1
site_env_set FI_CXI_DEFAULT_CQ_SIZE 131072
# NCCL: rings may cross NICs (4 NICs per node), and bootstrap goes over the Slingshot interfaces.
site_env_set NCCL_CROSS_NIC 1
site_env_set NCCL_SOCKET_IFNAME hsn
# NCCL_NET_GDR_LEVEL=PHB was in the 2024 profile; NCAR dropped it in 2025 for stability problems,
# so a value left over from an older profile is removed while the environment is active.
site_env_unset NCCL_NET_GDR_LEVEL
