"""``python -m fedind``: the same command line as the ``fedind`` script."""

from .cli import main

raise SystemExit(main())
