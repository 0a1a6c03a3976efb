"""The batch job of one unit: ``python -m channelsmith.scheduler BUILD_DIR UNIT_ID`` (written by submitting)."""

import sys
from pathlib import Path

from channelsmith.scheduler.job import run_unit

sys.exit(run_unit(Path(sys.argv[1]), sys.argv[2]))
