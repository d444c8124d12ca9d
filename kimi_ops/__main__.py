"""Command line: ``python -m kimi_ops demo [--batch B --context N --qlen Q ...]``."""

import argparse
import sys

from . import demo


class Parser(argparse.ArgumentParser):
    """A bad flag: one line on stderr saying what is wrong, exit status 2 (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def main(argv=None) -> int:
    parser = Parser(prog="python -m kimi_ops", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(commands.add_parser(
        "demo", help="decode N steps of a Kimi-K3 TP8 MLA layer and check them (--attention-only: the attention table)"))
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo.check_arguments(commands.choices["demo"], args)
        return demo.run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
