"""``python -m launch ...`` is the ``spreeze`` command, for an environment where its script is not on PATH."""
import sys

from launch.cli import main

sys.exit(main())
