import sys

from kvkeep.cli import main

sys.exit(main())
