"""``python -m ovqflex.cli``: the ``ovqflex`` command."""
import sys

from . import main

sys.exit(main())
