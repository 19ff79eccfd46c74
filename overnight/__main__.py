import sys

from overnight.cli import main

sys.exit(main())
