"""`python -m pkb` is the `pkb` command."""

import sys

from pkb.cli import main

sys.exit(main())
