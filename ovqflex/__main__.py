"""``python -m ovqflex``: the ``ovqflex`` command line (:mod:`ovqflex.cli`)."""
from .cli import main

raise SystemExit(main())
