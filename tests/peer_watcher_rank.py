"""One rank of a 2-rank gloo job for tests/test_peer_watcher_security.py, driven line by line on stdin.

    python peer_watcher_rank.py RANK

Each command's answer is one line on stdout (flushed): the test waits for it, never for time.
``START`` starts the watcher (watching nothing yet), ``WATCH`` watches the default group, ``STATUS``
prints what the watcher's thread holds as JSON, ``ALLREDUCE`` runs one all_reduce under guard(),
``LOST`` asks ``watcher.lost()`` (its answer: ``LOST <json or null> <seconds it took>``),
``HOG``/``UNHOG`` take/free every file descriptor this process may still open, ``STALL S`` holds the
GIL for S seconds in a C call (no other thread of this process runs Python meanwhile), ``STORE`` sets and
gets a key of the job's store, ``EXIT`` ends it. Standing in for something between the ranks (what
a stranger cannot do without privileges, and the watcher must survive anyway): ``SEVER PEER`` shuts
down this process's link to PEER, ``INJECT PEER HEX`` writes raw bytes into it.
Every loss the watcher reports is printed as ``LOSS <json>`` (rank, cause, detected_at: ``time.time()``
at the verdict) when it is handled, every new link as ``LINK <rank>`` (and counted in STATUS's ``made``).
TORCH_PEER_WATCHER_TEST_NOFILE lowers RLIMIT_NOFILE before anything is opened; TORCH_PEER_WATCHER_TEST_STORE=client
makes every rank a client of a store that another process (the test) hosts at MASTER_ADDR:MASTER_PORT;
TORCH_PEER_WATCHER_TEST_STORE_HOLD_S sets how long the watcher's store probe may hold its connection;
TORCH_PEER_WATCHER_TEST_JUDGING_S starts the probe that many seconds late (a verdict judged slowly, as
tests/slow_judging does in a process that starts afresh).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import socket
import sys
import threading
import time

NOFILE = os.environ.get("TORCH_PEER_WATCHER_TEST_NOFILE")
if NOFILE:
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(NOFILE), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_peer_watcher as tpw  # noqa: E402
from torch_peer_watcher import stores  # noqa: E402

if os.environ.get("TORCH_PEER_WATCHER_TEST_STORE_HOLD_S"):
    stores.STORE_HOLD_S = float(os.environ["TORCH_PEER_WATCHER_TEST_STORE_HOLD_S"])
if os.environ.get("TORCH_PEER_WATCHER_TEST_JUDGING_S"):
    from torch_peer_watcher import watcher as _watcher_module

    def _slow_probe(*args, _probe=_watcher_module.store_out_of_reach, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(float(os.environ["TORCH_PEER_WATCHER_TEST_JUDGING_S"]))
        return _probe(*args, **kwargs)

    _watcher_module.store_out_of_reach = _slow_probe

# gloo on CPU by default; PEER_WATCHER_RANK_BACKEND=nccl runs the same commands on GPUs (a GPU node).
BACKEND = os.environ.get("PEER_WATCHER_RANK_BACKEND", "gloo")
DEVICE: dict = {}
LINKS_MADE = [0]


_SAY = threading.Lock()


def say(*words: object) -> None:
    """One whole line on stdout: the link thread (LINK, LOSS) and the main thread both answer."""
    with _SAY:
        sys.stdout.write(" ".join(map(str, words)) + "\n")
        sys.stdout.flush()


# libc's functions called through PyDLL keep the GIL for the whole call.
_LIBC = ctypes.PyDLL(None)
_LIBC.poll.argtypes = (ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int)


def hold_gil(seconds: float) -> None:
    """Hold the GIL for ``seconds`` as a long C call that does not release it would: poll() with no file
    descriptor, called with the GIL held. No other thread of this process runs Python meanwhile, and no CPU
    is spent (a Python busy loop held it as well, but spun a core: 21 s of CPU in the default run)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        _LIBC.poll(None, 0, max(1, round(left * 1000)))


def status(watcher: tpw.PeerWatcher) -> dict:
    links = watcher._links
    assert links is not None
    thread = links.thread
    cpu = time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) if thread.is_alive() else None
    return {
        "alive": thread.is_alive(),
        "cpu_s": cpu,
        "links": sorted(links.links),
        "endpoints": {str(r): sorted(link.endpoints) for r, link in list(links.links.items())},
        "pending": len(links._pending),
        # Links made so far (the first ones included): a test waits for it to grow, not for a LINK line that
        # its previous command's answer may have come after.
        "made": LINKS_MADE[0],
        "losses": [[loss.rank, loss.cause] for loss in watcher.losses()],
        "judging": sorted(rank for rank, _ in watcher._ledger.judging),  # verdicts whose judging or aborts still run
    }


def main() -> None:
    rank = int(sys.argv[1])
    if BACKEND == "nccl":
        # One GPU per rank where there are two; else both share GPU 0 (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1).
        DEVICE["device_id"] = torch.device("cuda", rank % torch.cuda.device_count())
    if os.environ.get("TORCH_PEER_WATCHER_TEST_STORE") == "client":
        # The store in a process of its own (the test's), as torchrun's agent hosts it: every rank a client.
        from datetime import timedelta

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=60))  # fmt: skip
        dist.init_process_group(BACKEND, store=store, rank=rank, world_size=2, **DEVICE)
    else:
        dist.init_process_group(BACKEND, rank=rank, world_size=2, **DEVICE)
    say("INIT", os.getpid())
    watcher = None
    hog: list[int] = []
    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "START":
            watcher = tpw.start(watch_world=False)
            watcher.on_peer_lost(lambda loss: say("LOSS", json.dumps({"rank": loss.rank, "cause": loss.cause,
                                                                      "detected_at": loss.detected_at,
                                                                      "cut_off": loss.cut_off,
                                                                      "judged_s": loss.judged_s})))  # fmt: skip
            links_events = watcher._links.events
            on_link = links_events.on_link

            def linked(r: int, on_link=on_link) -> None:
                on_link(r)
                LINKS_MADE[0] += 1  # only the link thread writes it
                say("LINK", r)

            links_events.on_link = linked
            say("STARTED")
        elif command[0] == "WATCH":
            try:
                watcher.watch(None)
                say("WATCHED")
            except tpw.WatcherError as exc:
                say("WATCHERROR", " ".join(str(exc).split()))
        elif command[0] == "STATUS":
            say("STATUS", json.dumps(status(watcher)))
        elif command[0] == "ALLREDUCE":
            t = torch.ones(2, device=DEVICE.get("device_id"))
            try:
                with watcher.guard():
                    dist.all_reduce(t)
                say("REDUCED", t.tolist())
            except (tpw.PeerLostError, tpw.PartitionedError) as exc:
                word = "RAISED" if isinstance(exc, tpw.PeerLostError) else "PARTITIONED"
                say(word, json.dumps({"rank": exc.loss.rank, "cause": exc.loss.cause, "cut": exc.loss.sockets_cut,
                                      "errors": exc.loss.errors, "cut_off": exc.loss.cut_off}))  # fmt: skip
        elif command[0] == "LOST":
            started = time.monotonic()
            loss = watcher.lost()
            found = None if loss is None else {"rank": loss.rank, "cut_off": loss.cut_off}
            say("LOST", json.dumps(found), round(time.monotonic() - started, 4))
        elif command[0] == "STALL":
            # Hold the GIL for the given seconds: the watcher's thread cannot run (no heartbeat, no verdict),
            # while the store's server thread (C++) goes on serving, as in a long C call.
            hold_gil(float(command[1]))
            say("STALLED")
        elif command[0] == "HOG":
            while True:
                try:
                    hog.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    break
            say("HOGGED", len(hog))
        elif command[0] == "UNHOG":
            for fd in hog:
                os.close(fd)
            hog.clear()
            say("UNHOGGED")
        elif command[0] == "STORE":
            try:
                store = dist.distributed_c10d._get_default_store()
                store.set("peer_watcher_rank/probe", str(rank))
                say("STORED", store.get("peer_watcher_rank/probe").decode())
            except Exception as exc:  # the answer the test judges
                say("STOREERROR", type(exc).__name__, " ".join(str(exc).split())[:200])
        elif command[0] in ("SEVER", "INJECT"):
            sock = watcher._links.links[int(command[1])].sock
            if command[0] == "SEVER":
                sock.shutdown(socket.SHUT_RDWR)
            else:
                sock.sendall(bytes.fromhex(command[2]))
            say(command[0] + "ED")
        elif command[0] == "EXIT":
            os._exit(0)


if __name__ == "__main__":
    main()
