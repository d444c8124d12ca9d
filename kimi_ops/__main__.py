"""Command line: ``python -m kimi_ops demo [--batch B --context N --qlen Q ...]``."""

import argparse
import sys

from . import demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kimi_ops", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(commands.add_parser(
        "demo", help="decode N steps of a Kimi-K3 TP8 MLA layer and check them (--attention-only: the attention table)"))
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
