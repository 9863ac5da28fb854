"""`python -m kairox.cli`: the kairox command line, as `python -m kairox`."""
import sys

from . import main

sys.exit(main())
