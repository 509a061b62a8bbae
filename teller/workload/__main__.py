"""``python -m teller.workload serve ...``: the workload without the ``teller`` entry point."""

import sys

from teller.workload.cli import main

sys.exit(main())
