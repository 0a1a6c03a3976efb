"""A child for tests/test_dist_check_forkserver.py: says how it started, then ends as its first argument asks."""

import atexit
import gc
import json
import os
import sys
import time

# Read as the module starts: true only when the process had torch before it ran (a fork server's child).
TORCH_BEFORE_START = "torch" in sys.modules
# Objects the process's collector skips (harness/startup.py freezes what the server's imports made), and
# whether it collects at all: both as the module starts.
FROZEN_BEFORE_START, COLLECTING_AT_START = gc.get_freeze_count(), gc.isenabled()
# Where torch reads TORCHINDUCTOR_CACHE_DIR (harness/forkserver.py applies it in the child): not imported yet.
INDUCTOR_CACHE_BEFORE_START = "torch._inductor.runtime.cache_dir_utils" in sys.modules


def main() -> None:
    mode = sys.argv[1]
    said = {
        "argv": sys.argv[1:], "ppid": os.getppid(), "torch_before_start": TORCH_BEFORE_START, "cwd": os.getcwd(),
        "marker": os.environ.get("TORCH_DIST_CHECK_TEST_MARKER"), "name": __name__,
        "inductor_cache_before_start": INDUCTOR_CACHE_BEFORE_START, "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "frozen_before_start": FROZEN_BEFORE_START, "collecting_at_start": COLLECTING_AT_START,
    }  # fmt: skip
    print(json.dumps(said), flush=True)
    print("a line to stderr", file=sys.stderr)
    atexit.register(lambda: print("exit handler ran", flush=True))
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "raise":
        raise RuntimeError("planted in the child")
    if mode == "message":
        sys.exit("a message instead of a status")
    if mode == "sleep":
        time.sleep(120)


if __name__ == "__main__":
    main()
