"""``python -m fairlimit`` runs the CLI."""

from fairlimit.cli import main

raise SystemExit(main())
