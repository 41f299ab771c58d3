"""`python -m clients ...`: the command-line client."""

import sys

from clients.cli import main

sys.exit(main())
