"""``python -m torch_dist_check.tables``: the tables of the GPU runs; see :mod:`torch_dist_check.report.tables`."""

import sys

from torch_dist_check.report.tables import main

if __name__ == "__main__":
    sys.exit(main())
