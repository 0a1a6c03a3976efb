"""Build torch_mpi_backend: PyTorch's ProcessGroupMPI.cpp plus our registration code, as a torch C++ extension.

build.sh copies the (patched) ProcessGroupMPI.cpp next to register.cpp and passes the site MPI's
compile and link flags, read from its mpicc wrapper, in TORCH_MPI_BACKEND_MPI_CFLAGS/_LDFLAGS.
torch.utils.cpp_extension supplies the rest: torch's include paths, its C++ ABI flag and pybind11 ABI
tags, and links c10, torch, torch_cpu and torch_python.
"""

import os
import shlex

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension


def _env_flags(name: str) -> list[str]:
    return shlex.split(os.environ.get(name, ""))


setup(
    name="torch-mpi-backend",
    version=os.environ["TORCH_MPI_BACKEND_TORCH_VERSION"],
    packages=["torch_mpi_backend"],
    ext_modules=[
        CppExtension(
            "torch_mpi_backend._C",
            ["torch_mpi_backend/ProcessGroupMPI.cpp", "torch_mpi_backend/register.cpp"],
            # ProcessGroupMPI.hpp/.cpp compile to nothing without USE_C10D_MPI (PyTorch sets it when
            # USE_MPI=1). Both files use MPI's C API only: without the SKIP macros, mpi.h included from
            # C++ pulls in the MPI C++ bindings, whose symbols live in libmpi_cxx (Open MPI), which the
            # C wrapper's flags do not link ("undefined symbol: _ZN3MPI8Datatype4FreeEv").
            define_macros=[("USE_C10D_MPI", None), ("OMPI_SKIP_MPICXX", "1"), ("MPICH_SKIP_MPICXX", "1")],
            extra_compile_args=_env_flags("TORCH_MPI_BACKEND_MPI_CFLAGS"),
            extra_link_args=_env_flags("TORCH_MPI_BACKEND_MPI_LDFLAGS"),
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
