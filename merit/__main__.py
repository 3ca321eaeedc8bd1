"""``python -m merit``: the ``merit`` command."""

import sys

from merit.cli import main

sys.exit(main())
