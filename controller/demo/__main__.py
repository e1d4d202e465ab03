"""``python -m controller.demo`` runs the demo model server (see ``controller.demo``)."""

from controller.demo.server import main

raise SystemExit(main())
