"""torch_peer_watcher.ncclgroups against a real NCCL library, on CPU.

Issue 20: PyTorch's single send/recv opens an NCCL group and throws before it ends it when NCCL
returns an error (a dead peer), so the thread stays inside that group and the next communicator it
creates is never initialised. Seen on one H100 with stock PyTorch 2.11.0; the GPU runs are in
docs/records/2026-11-25-peer-loss-one-h100.md. Here: the group functions need no GPU, so the real ``libnccl.so.2`` of
the ``nvidia-nccl-cu12`` wheel that ``channelsmith patches compile-check`` fetches (CI runs it
before the tests) shows what is closed, in which thread, and that nothing is touched without NCCL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from channelsmith.patches.compiling import unpack_wheel  # noqa: E402
from channelsmith.sources import cache_root  # noqa: E402


def nccl_library() -> Path | None:
    """libnccl.so.2 of the newest cached nvidia-nccl-cu12 wheel, unpacked once into the cache."""
    wheels = sorted((cache_root() / "wheels").glob("nvidia_nccl_cu12-*.whl"))
    if not wheels:
        return None
    return unpack_wheel(wheels[-1], "nvidia/nccl/lib/", cache_root()) / "libnccl.so.2"


@pytest.fixture(scope="module")
def libnccl() -> Path:
    library = nccl_library()
    if library is None:
        pytest.skip(f"no nvidia-nccl-cu12 wheel in {cache_root() / 'wheels'} (`channelsmith patches compile-check` fetches it)")
    return library


def run(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(SCRIPTS)))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_only_the_groups_this_thread_left_open_are_closed(libnccl):
    out = run(f"""
        import ctypes, threading
        from torch_peer_watcher.ncclgroups import close_leaked_groups, loaded_nccl
        lib = ctypes.CDLL({str(libnccl)!r})   # as torch loads it
        assert loaded_nccl() is not None
        # What two failed send/recv calls leave behind: groups started and never ended.
        lib.ncclGroupStart(); lib.ncclGroupStart()
        other = []
        def elsewhere():
            lib.ncclGroupStart()
            other.append(close_leaked_groups())
        thread = threading.Thread(target=elsewhere); thread.start(); thread.join()
        print(other[0], close_leaked_groups(), close_leaked_groups())
        # The thread works normally again: a group opened and ended answers ncclSuccess.
        print(lib.ncclGroupStart(), lib.ncclGroupEnd())
    """)
    assert out == ["1", "2", "0", "0", "0"]


def test_a_process_without_nccl_is_left_alone():
    out = run("""
        from torch_peer_watcher.ncclgroups import close_leaked_groups, loaded_nccl
        print(loaded_nccl() is None, close_leaked_groups())
    """)
    assert out == ["True", "0"]


def test_groups_left_open_in_a_second_nccl_beside_the_first_are_closed_too(libnccl, tmp_path):
    """Issue 38: PyPI's CUDA PyTorch loads its wheel's libnccl.so.2 at import; a program can load another
    NCCL by path beside it. The soname finds only the first, so the group left open in the second
    stayed open. Two copies of one library at two paths are two NCCLs to the loader, as two builds are."""
    second = tmp_path / "other" / "libnccl.so.2"
    second.parent.mkdir()
    second.write_bytes(libnccl.read_bytes())
    out = run(f"""
        import ctypes
        from torch_peer_watcher.ncclgroups import close_leaked_groups, loaded_nccl_paths
        first = ctypes.CDLL({str(libnccl)!r})    # PyTorch's
        second = ctypes.CDLL({str(second)!r})    # another one, loaded by path
        print(len(loaded_nccl_paths()), loaded_nccl_paths()[1] == {str(second)!r})
        second.ncclGroupStart(); second.ncclGroupStart(); first.ncclGroupStart()
        print(close_leaked_groups(), close_leaked_groups())
        print(second.ncclGroupStart(), second.ncclGroupEnd(), first.ncclGroupStart(), first.ncclGroupEnd())
    """)
    assert out == ["2", "True", "3", "0", "0", "0", "0", "0"]
