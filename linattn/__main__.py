"""``python -m linattn``: the command-line interface."""

from linattn.cli import main

raise SystemExit(main())
