"""Load test of `aieng serve` (the program lives in aieng.benchmarks.load_test, so that
`aieng bench --serve` runs it from any install); see that module for the options."""

import sys

from aieng.benchmarks.load_test import main

if __name__ == "__main__":
    sys.exit(main())
