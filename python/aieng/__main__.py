import sys

from aieng.cli import main

sys.exit(main())
