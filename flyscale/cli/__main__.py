"""`python -m flyscale.cli`, as the `flyscale` console script."""

import sys

from flyscale.cli import main

sys.exit(main())
