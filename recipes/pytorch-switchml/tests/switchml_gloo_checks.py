"""Checks of an installed pytorch-switchml with SwitchML's dummy backend and world size 1.

Usage: python switchml_gloo_checks.py CHECK, where CHECK is one of
  linked     torch's libraries carry SwitchML and our gloo integration
  cpu        with ./switchml.cfg (num_workers=2): a CPU allreduce is gloo's, so unchanged
  no-config  with no switchml.cfg anywhere: a warning, and gloo's result
  groups     a second gloo group comes and goes; the default group still reduces and the
             process shuts down cleanly (SwitchML's context is reference-counted)
  cuda       with a GPU and num_workers=2: CUDA float32 and int32 allreduces come back doubled
             (the dummy backend plays the second worker), float64 unchanged (gloo fallback)

Every check runs torch.distributed in a fresh child process inside a temporary directory, since
SwitchML reads ./switchml.cfg from the working directory and its context lives once per process.
Runs on the Python of PyTorch 1.7.1 (3.8).
"""

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

CHECKS = ("linked", "cpu", "no-config", "groups", "cuda")
# Our warning (patch 0002) and SwitchML's own fatal message: both are compiled into torch.
OUR_WARNING = b"SwitchML: no configuration file"
SWITCHML_MESSAGE = b"Could not start the context due to missing configuration"


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def write_config(directory, num_workers):
    """./switchml.cfg from the template switchml-client installs, dummy backend, N workers."""
    template = Path(sys.prefix) / "share" / "switchml" / "switchml.cfg"
    if not template.is_file():
        fail("switchml-client's template is missing: {}".format(template))
    lines = []
    for line in template.read_text().splitlines():
        key = line.split("=", 1)[0].strip()
        if key == "num_workers":
            line = "num_workers = {}".format(num_workers)
        elif key == "backend":
            line = "backend = dummy"
        lines.append(line)
    (directory / "switchml.cfg").write_text("\n".join(lines) + "\n")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_child(check, config_workers):
    """Run this file's child part for `check` in a fresh directory; returns (rc, output)."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        if config_workers:
            write_config(directory, config_workers)
        env = dict(os.environ, SWITCHML_CHECK_PORT=str(free_port()))
        result = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "_child", check],
            cwd=str(directory), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            universal_newlines=True, timeout=300,
        )
    print(result.stdout)
    return result.returncode, result.stdout


def check_linked():
    import torch

    libraries = sorted((Path(torch.__file__).parent / "lib").glob("*.so*"))
    found = {}
    for library in libraries:
        data = library.read_bytes()
        for marker in (OUR_WARNING, SWITCHML_MESSAGE):
            if marker in data:
                found.setdefault(marker, library.name)
    for marker in (OUR_WARNING, SWITCHML_MESSAGE):
        if marker not in found:
            fail("no torch library contains {!r}: SwitchML is not linked".format(marker))
    print("linked: OK ({})".format(", ".join("{!r} in {}".format(m.decode(), n) for m, n in found.items())))


def parent(check):
    if check == "linked":
        check_linked()
        return
    if check == "no-config" and Path("/etc/switchml.cfg").exists():
        fail("/etc/switchml.cfg exists on this machine, so the no-config case cannot be shown here")
    workers = 0 if check == "no-config" else 2
    rc, output = run_child(check, workers)
    if rc != 0:
        fail("{} exited with {} (a negative value is a signal: SwitchML aborted?)".format(check, rc))
    if check == "no-config" and OUR_WARNING.decode() not in output:
        fail("no-config: the SwitchML warning was not printed")
    if "{}: OK".format(check) not in output and "{}: SKIPPED".format(check) not in output:
        fail("{}: the child did not report a result".format(check))


def child(check):
    import torch
    import torch.distributed as dist

    port = os.environ["SWITCHML_CHECK_PORT"]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=0, world_size=1)

    def allreduce(tensor, group=None, op=dist.ReduceOp.SUM):
        expected = tensor.clone()
        if group is None:
            dist.all_reduce(tensor, op=op)
        else:
            dist.all_reduce(tensor, op=op, group=group)
        return expected, tensor

    def assert_unchanged(name, pair):
        before, after = pair
        if not torch.equal(before.cpu(), after.cpu()):
            fail("{}: expected gloo's result (unchanged with world size 1), got {}".format(name, after[:4]))

    def assert_doubled(name, pair):
        before, after = pair
        before, after = before.cpu().double(), after.cpu().double()
        if not torch.allclose(after, 2 * before, rtol=0.01, atol=0.0):
            fail("{}: expected 2x the input (SwitchML, num_workers=2), got {} for {}".format(
                name, after[:4].tolist(), before[:4].tolist()))

    values = torch.arange(1, 4097)
    if check in ("cpu", "no-config"):
        assert_unchanged("cpu float32", allreduce(values.float()))
        assert_unchanged("cpu int32", allreduce(values.int()))
        if check == "no-config" and torch.cuda.is_available():
            assert_unchanged("cuda float32 without config", allreduce(values.float().cuda()))
    elif check == "groups":
        second = dist.new_group([0])
        assert_unchanged("cpu float32 on a second group", allreduce(values.float(), second))
        dist.destroy_process_group(second)
        del second
        assert_unchanged("cpu float32 after the second group", allreduce(values.float()))
        if torch.cuda.is_available():
            assert_doubled("cuda float32 after the second group", allreduce(values.float().cuda()))
    elif check == "cuda":
        if not torch.cuda.is_available():
            print("cuda: SKIPPED (torch.cuda.is_available() is False: no GPU on this machine)")
            dist.destroy_process_group()
            return
        assert_doubled("cuda float32", allreduce(values.float().cuda()))
        assert_doubled("cuda int32", allreduce(values.int().cuda()))
        assert_unchanged("cuda float64", allreduce(values.double().cuda()))
        assert_unchanged("cuda float32 PRODUCT", allreduce(values.float().cuda(), op=dist.ReduceOp.PRODUCT))
    dist.destroy_process_group()
    print("{}: OK".format(check))


def main(argv):
    if len(argv) == 3 and argv[1] == "_child":
        child(argv[2])
    elif len(argv) == 2 and argv[1] in CHECKS:
        parent(argv[1])
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv)
