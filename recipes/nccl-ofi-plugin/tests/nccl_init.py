"""Initialise one NCCL communicator on GPU 0 through ctypes, so NCCL loads its network plugin.

NCCL loads and initialises its network plugin for every communicator, a one-rank one included.
Exit status 0 when ncclCommInitAll succeeded, 1 otherwise. NCCL_DEBUG=INFO output goes to stdout,
followed by "nccl_init: mapped PATH" for each NCCL, network plugin and libfabric file this process
has mapped (older NCCL releases name the plugin's network but not its file).
"""

import ctypes
import re
import sys


def mapped(pattern):
    """Paths of mapped files whose name matches ``pattern``, in map order."""
    seen = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                path = parts[5].strip()
                if re.search(pattern, path.rsplit("/", 1)[-1]) and path not in seen:
                    seen.append(path)
    return seen


nccl = ctypes.CDLL("libnccl.so.2")
comm = ctypes.c_void_p()
result = nccl.ncclCommInitAll(ctypes.byref(comm), 1, None)
for path in mapped(r"^(libnccl\.so|libnccl-net|libfabric\.so)"):
    print(f"nccl_init: mapped {path}", flush=True)
if result != 0:
    nccl.ncclGetErrorString.restype = ctypes.c_char_p
    print(f"ncclCommInitAll failed: {nccl.ncclGetErrorString(result).decode()}", flush=True)
    sys.exit(1)
nccl.ncclCommDestroy(comm)
print("ncclCommInitAll: ok", flush=True)
