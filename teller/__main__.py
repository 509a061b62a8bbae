"""`python -m teller`: the same command as `teller`."""

from teller.cli import main

raise SystemExit(main())
