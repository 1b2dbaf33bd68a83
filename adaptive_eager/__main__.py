"""`python -m adaptive_eager`: the same command line as `adaptive-eager`."""
import sys

from .cli import main

sys.exit(main())
