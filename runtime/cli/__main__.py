"""``python -m runtime.cli``: the ``lmc`` command."""
import sys

from runtime.cli import main

sys.exit(main())
