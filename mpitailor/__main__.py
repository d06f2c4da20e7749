import sys

from mpitailor.cli import main

sys.exit(main())
