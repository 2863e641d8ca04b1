"""``python -m vvs_engine`` = the ``vvs-engine`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
