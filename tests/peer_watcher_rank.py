"""One rank of a 2-rank gloo job for tests/test_peer_watcher_security.py, driven line by line on stdin.

    python peer_watcher_rank.py RANK

Each command's answer is one line on stdout (flushed): the test waits for it, never for time.
``START`` starts the watcher (watching nothing yet), ``WATCH`` watches the default group, ``STATUS``
prints what the watcher's thread holds as JSON, ``ALLREDUCE`` runs one all_reduce under guard(),
``HOG``/``UNHOG`` take/free every file descriptor this process may still open, ``EXIT`` ends it.
Every loss the watcher reports is printed as ``LOSS <rank> <cause>`` when it is handled.
TORCH_PEER_WATCHER_TEST_NOFILE lowers RLIMIT_NOFILE before anything is opened.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

NOFILE = os.environ.get("TORCH_PEER_WATCHER_TEST_NOFILE")
if NOFILE:
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(NOFILE), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_peer_watcher as tpw  # noqa: E402


def say(*words: object) -> None:
    print(*words, flush=True)


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
        "losses": [[loss.rank, loss.cause] for loss in watcher.losses()],
    }


def main() -> None:
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    say("INIT", os.getpid())
    watcher = None
    hog: list[int] = []
    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "START":
            watcher = tpw.start(watch_world=False)
            watcher.on_peer_lost(lambda loss: say("LOSS", loss.rank, loss.cause))
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
            t = torch.ones(2)
            try:
                with watcher.guard():
                    dist.all_reduce(t)
                say("REDUCED", t.tolist())
            except tpw.PeerLostError as exc:
                say("RAISED", json.dumps({"rank": exc.loss.rank, "cause": exc.loss.cause, "cut": exc.loss.sockets_cut,
                                          "errors": exc.loss.errors}))  # fmt: skip
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
        elif command[0] == "EXIT":
            os._exit(0)


if __name__ == "__main__":
    main()
