import sys

from dynmo_plugin.cli import main

sys.exit(main())
