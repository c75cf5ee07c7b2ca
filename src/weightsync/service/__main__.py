"""``python -m weightsync.service serve …`` / ``migrate …`` (works before the main CLI wires ``serve``)."""

from weightsync.service.cli import main

main()
