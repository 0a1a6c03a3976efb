import sys

from channelsmith.cli import main

sys.exit(main())
