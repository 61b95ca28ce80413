import sys

from archlab.cli import main

sys.exit(main())
