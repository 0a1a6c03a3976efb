"""torch_dist_check: prove on the real nodes that a deployed PyTorch's distributed stack works.

Run it as ``python -m torch_dist_check`` under torchrun, mpiexec/mpirun, srun, or on its own with
``--nproc N``. It checks the environment (which NCCL is loaded, which NCCL network plugin was picked,
the MPI library and whether it is CUDA-aware), the correctness of every collective on every available
backend, the bandwidth of each backend (a sweep like NVIDIA's nccl-tests), and whether a job survives
a dead peer (NCCL fault tolerance). It needs PyTorch and NumPy only; mpi4py and matplotlib are optional.

This package imports nothing from channelsmith, so it installs on a cluster with PyTorch (and NumPy) alone.
"""

__version__ = "0.1.0"
