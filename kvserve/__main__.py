"""`python -m kvserve ...` is the `kvserve` command."""

import sys

from kvserve.cli import main

sys.exit(main())
