import sys

from recship.cli import main

sys.exit(main())
