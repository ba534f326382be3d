"""``python -m shards``: see :mod:`shards.cli`."""

from shards.cli import main

raise SystemExit(main())
