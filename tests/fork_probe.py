"""Probe programs for tests/test_dist_check_forkserver.py: each observes what its process was given and how
it ends, and is run both ways (forked from a fork server, and as an interpreter of its own) to compare.

    python fork_probe.py PROBE [FILE]    (or -m fork_probe, or -c with this file's source)

Probes: ``observe`` prints what the process inherited and read as it started; ``ending`` leaves work for
the interpreter's end (a non-daemon thread, an executor job never awaited, an exit handler, a file written
and never closed, its buffer unflushed) and writes FILE; ``hook`` dies of an exception that its
``sys.excepthook`` turns into exit status 3; ``raise``, ``interrupt``, ``message`` and ``status`` end by an
uncaught exception, an uncaught ^C, ``sys.exit("...")`` and ``sys.exit(5)``.
"""

import atexit
import concurrent.futures
import json
import locale
import os
import resource
import signal
import sys
import threading
import time


def _status_line(name: str) -> str:
    for line in open("/proc/self/status"):
        if line.startswith(name + ":"):
            return line.split()[1]
    return ""


def _descriptors() -> dict[str, str]:
    """Every open descriptor and what it is (a pipe's or socket's inode left out: they differ by nature)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor, closed since
        found[name] = target.split(":")[0] if target.startswith(("pipe:", "socket:", "anon_inode:")) else target
    return found


def observe() -> None:
    main = sys.modules["__main__"]
    print(json.dumps({
        "argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": getattr(main, "__file__", None),
        "main_names": sorted(name for name in vars(main) if name.startswith("__")),
        "environ": {k: v for k, v in os.environ.items() if k.startswith(("RANK", "MASTER_", "GLOO_", "TORCH_DIST_CHECK_", "TZ", "LC_"))},
        "hash": hash("the same string in every process?"), "tzname": list(time.tzname),
        "ctype": locale.setlocale(locale.LC_CTYPE), "descriptors": _descriptors(),
        "umask": _status_line("Umask"), "blocked": _status_line("SigBlk"), "ignored": _status_line("SigIgn"),
        "caught": _status_line("SigCgt"), "sigint": repr(signal.getsignal(signal.SIGINT)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0), "affinity": sorted(os.sched_getaffinity(0)),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE), "core": resource.getrlimit(resource.RLIMIT_CORE),
        "cwd": os.getcwd(), "stdout_line_buffering": sys.stdout.line_buffering,
    }, sort_keys=True))  # fmt: skip


def ending(path: str) -> None:
    def late_thread() -> None:
        time.sleep(0.3)
        print("the non-daemon thread ran to its end", flush=True)

    def job() -> None:
        time.sleep(0.2)
        print("the executor's job ran", flush=True)

    threading.Thread(target=late_thread).start()
    concurrent.futures.ThreadPoolExecutor(1).submit(job)
    atexit.register(lambda: print("the exit handler ran after the threads", flush=True))
    kept = open(path, "w")  # never closed nor flushed: what the interpreter's end does with it shows
    kept.write("written, never flushed\n")
    globals()["kept"] = kept
    print("the main code ended")


def hook() -> None:
    def turn_into_status(kind, value, tb) -> None:  # noqa: ANN001
        print(f"the hook saw {kind.__name__}: {value}", file=sys.stderr)
        sys.exit(3)

    sys.excepthook = turn_into_status
    raise RuntimeError("handed to the hook")


def main() -> None:
    probe = sys.argv[1]
    if probe == "observe":
        observe()
    elif probe == "ending":
        ending(sys.argv[2])
    elif probe == "hook":
        hook()
    elif probe == "raise":
        raise ValueError("uncaught in the probe")
    elif probe == "interrupt":
        raise KeyboardInterrupt
    elif probe == "message":
        sys.exit("a message instead of a status")
    elif probe == "status":
        sys.exit(5)


if __name__ == "__main__":
    main()
