"""Initialise one NCCL communicator on GPU 0 through ctypes, so NCCL loads its network plugin.

Exit status 0 when ncclCommInitAll succeeded, 1 otherwise; NCCL_DEBUG=INFO output goes to stdout.
"""

import ctypes
import sys

nccl = ctypes.CDLL("libnccl.so.2")
comm = ctypes.c_void_p()
result = nccl.ncclCommInitAll(ctypes.byref(comm), 1, None)
if result != 0:
    nccl.ncclGetErrorString.restype = ctypes.c_char_p
    print(f"ncclCommInitAll failed: {nccl.ncclGetErrorString(result).decode()}", flush=True)
    sys.exit(1)
nccl.ncclCommDestroy(comm)
print("ncclCommInitAll: ok", flush=True)
