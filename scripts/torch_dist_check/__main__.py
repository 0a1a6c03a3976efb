"""``python -m torch_dist_check``: see :mod:`torch_dist_check.cli`."""

import sys

from torch_dist_check.cli import main

sys.exit(main())
