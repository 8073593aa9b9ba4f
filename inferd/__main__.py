import sys

from inferd.cli import main

sys.exit(main())
