"""Checks of an installed torch-switchml with SwitchML's dummy backend and world size 1.

Run without arguments. Two child processes, each in a fresh directory (SwitchML reads
./switchml.cfg there, and its context lives once per process):
  with-config  num_workers=2: float32 and int32 allreduces come back doubled (the dummy backend
               plays the second worker); float64 and MAX are gloo's (unchanged); broadcast and
               barrier run on gloo; a second "switchml" group comes and goes and the default group
               still aggregates; the process shuts down cleanly.
  no-config    a warning, the group does not use SwitchML, and every result is gloo's.
Exit status 0 when both pass. CUDA tensors take the same path through a host copy; this check
uses CPU tensors so that it runs anywhere.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

WARNING = "SwitchML: no configuration file"


def fail(message: str) -> None:
    print(f"FAIL: {message}")
    sys.exit(1)


def write_config(directory: Path) -> None:
    """./switchml.cfg from switchml-client's template: dummy backend, two workers."""
    template = Path(sys.prefix) / "share" / "switchml" / "switchml.cfg"
    if not template.is_file():
        fail(f"switchml-client's template is missing: {template}")
    lines = []
    for line in template.read_text().splitlines():
        key = line.split("=", 1)[0].strip()
        if key == "num_workers":
            line = "num_workers = 2"
        elif key == "backend":
            line = "backend = dummy"
        lines.append(line)
    (directory / "switchml.cfg").write_text("\n".join(lines) + "\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_child(case: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        if case == "with-config":
            write_config(directory)
        env = dict(os.environ, SWITCHML_CHECK_PORT=str(free_port()))
        result = subprocess.run([sys.executable, os.path.abspath(__file__), "_child", case], cwd=directory,
                                env=env, capture_output=True, text=True, timeout=300, check=False)
    print(result.stdout + result.stderr)
    if result.returncode != 0:
        fail(f"{case} exited with {result.returncode} (a negative value is a signal: SwitchML aborted?)")
    if f"{case}: OK" not in result.stdout:
        fail(f"{case}: the child did not report a result")
    return result.stdout + result.stderr


def child(case: str) -> None:
    import torch
    import torch.distributed as dist

    import torch_switchml

    dist.init_process_group("switchml", init_method=f"tcp://127.0.0.1:{os.environ['SWITCHML_CHECK_PORT']}",
                            rank=0, world_size=1)
    using = torch_switchml.uses_switchml(dist.group.WORLD._get_backend(torch.device("cpu")))
    if using != (case == "with-config"):
        fail(f"{case}: uses_switchml is {using}")
    factor = 2 if using else 1

    def reduced(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, group=None) -> torch.Tensor:
        dist.all_reduce(tensor, op=op, group=group)
        return tensor

    values = torch.arange(1, 4097)
    checks = {
        "float32 SUM": (reduced(values.float()), values.double() * factor),
        "int32 SUM": (reduced(values.int()), values.double() * factor),
        "float64 SUM (gloo)": (reduced(values.double()), values.double()),
        "float32 MAX (gloo)": (reduced(values.float(), dist.ReduceOp.MAX), values.double()),
    }
    broadcast = values.float()
    dist.broadcast(broadcast, src=0)
    dist.barrier()
    checks["broadcast (gloo)"] = (broadcast, values.double())
    second = dist.new_group([0], backend="switchml")
    checks["float32 SUM on a second group"] = (reduced(values.float(), group=second), values.double() * factor)
    dist.destroy_process_group(second)
    del second
    checks["float32 SUM after the second group"] = (reduced(values.float()), values.double() * factor)
    for name, (got, expected) in checks.items():
        if not torch.allclose(got.double(), expected, rtol=0.01, atol=0.0):
            fail(f"{case}: {name}: got {got[:4].tolist()}, expected {expected[:4].tolist()}")
        print(f"{case}: {name}: {got[:3].tolist()} for input {values[:3].tolist()}")
    dist.destroy_process_group()
    print(f"{case}: OK")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_child":
        child(sys.argv[2])
        return
    if Path("/etc/switchml.cfg").exists():
        fail("/etc/switchml.cfg exists on this machine, so the no-config case cannot be shown here")
    run_child("with-config")
    if WARNING not in run_child("no-config"):
        fail("no-config: the SwitchML warning was not printed")
    print("switchml_backend_checks: PASS")


if __name__ == "__main__":
    main()
