"""Build torch_switchml: our SwitchML c10d backend as a torch C++ extension.

build.sh passes switchml-client's compile and link flags (from its pkg-config file) in
TORCH_SWITCHML_CFLAGS and TORCH_SWITCHML_LDFLAGS. torch.utils.cpp_extension supplies the rest:
torch's include paths, its C++ ABI flag and pybind11 ABI tags, and links c10, torch, torch_cpu
and torch_python. The torch this is compiled against is recorded in torch_switchml/_built_against.py.
"""

import os
import shlex
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension


def _env_flags(name: str) -> list[str]:
    return shlex.split(os.environ.get(name, ""))


Path("torch_switchml/_built_against.py").write_text(
    '"""The torch this build of torch_switchml was compiled against (written by setup.py)."""\n\n'
    f"TORCH_VERSION = {torch.__version__!r}\nTORCH_GIT_VERSION = {torch.version.git_version!r}\n"
)

setup(
    name="torch-switchml",
    version=os.environ.get("PKG_VERSION", "1.0.0"),
    packages=["torch_switchml"],
    ext_modules=[
        CppExtension(
            "torch_switchml._C",
            ["torch_switchml/backend.cpp"],
            extra_compile_args=["-std=c++17", *_env_flags("TORCH_SWITCHML_CFLAGS")],
            extra_link_args=_env_flags("TORCH_SWITCHML_LDFLAGS"),
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
