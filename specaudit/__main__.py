"""`python -m specaudit` is the `specaudit` command."""

import sys

from specaudit.cli import main

sys.exit(main())
