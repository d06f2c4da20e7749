import sys

from mpitailor.cli.main import main

sys.exit(main())
