"""Train an agent: ``python run.py --env Walker2DBulletEnv-v0`` (``--help`` lists every setting).

The work happens in the composition root, ``launch.compose``, which the installed ``spreeze train`` runs too."""
import sys

from launch.compose import main

if __name__ == "__main__":
    sys.exit(main())
