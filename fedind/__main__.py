"""``python -m fedind``: the same command line as the ``fedind`` script."""

from .cli.main import main

raise SystemExit(main())
