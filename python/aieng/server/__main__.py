"""`python -m aieng.server [MODEL] [flags]`: the same as `aieng serve`."""

import argparse
import sys

from aieng.server.cli import add_serve_arguments, run_serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aieng.server", description="An OpenAI-compatible server over aieng."
    )
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
