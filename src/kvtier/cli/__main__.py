"""`python -m kvtier.cli ARGS`: the same as `kvtier ARGS` (e.g. `python -m kvtier.cli demo`)."""

from kvtier.cli.main import main

raise SystemExit(main())
