import sys

from conveyor.entrypoints.cli import main

sys.exit(main())
