"""``python -m controller`` runs the ``slotctl`` CLI."""

import sys

from controller.cli.main import main

sys.exit(main())
