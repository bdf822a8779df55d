"""``python -m ferryman`` is the ``ferryman`` command."""

import sys

from ferryman.cli import main

sys.exit(main())
