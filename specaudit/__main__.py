"""`python -m specaudit` is the `specaudit` command."""

import sys

from specaudit.equivalence.cli import main

sys.exit(main())
