import sys

from nestpipe.cli import main

sys.exit(main())
