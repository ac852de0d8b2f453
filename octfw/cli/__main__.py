"""``python -m octfw.cli``: the ``octfw`` command (what the launcher starts each worker with)."""

import sys

from octfw.cli.main import main

sys.exit(main())
