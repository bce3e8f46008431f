"""``python -m genjax.cli``: the ``genjax`` command."""

import sys

from genjax.cli import main

sys.exit(main())
