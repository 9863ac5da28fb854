"""`python -m kairox`: the kairox command line (kairox.cli)."""
import sys

from .cli import main

sys.exit(main())
