"""The batch jobs: a build's unit, ``python -m channelsmith.scheduler BUILD_DIR UNIT_ID`` (written by
submitting), or the acceptance suite, ``python -m channelsmith.scheduler --verify RUN_DIR`` (verifying)."""

import sys
from pathlib import Path

from channelsmith.scheduler.job import run_unit
from channelsmith.scheduler.verifying import run_job

if sys.argv[1] == "--verify":
    sys.exit(run_job(Path(sys.argv[2])))
sys.exit(run_unit(Path(sys.argv[1]), sys.argv[2]))
