"""``python -m recship.trainer`` (what torchrun runs): the same as ``recship train``."""

import sys

from recship.trainer.cli import main

sys.exit(main())
