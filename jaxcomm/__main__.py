"""``python -m jaxcomm`` runs the command line (see :mod:`jaxcomm.cli`)."""

import sys

from .cli import main

sys.exit(main())
