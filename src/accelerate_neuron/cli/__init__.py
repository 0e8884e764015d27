"""The ``accelerate-neuron`` command: ``env`` (check the setup), ``simulate`` (dry run), ``demo`` (the main job),
``precompile`` (fill the NEFF cache ahead of a job), ``cache`` (the local and remote compile caches)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._children import Terminated
from ._common import ArgumentParser, CliError

DESCRIPTION = """\
accelerate-neuron runs stock Hugging Face code (Transformers, Accelerate,
Trainer, generate) on AWS Trainium through the native PyTorch Neuron backend,
with no change to your script. Without Trainium, a simulated Neuron device
shows what would happen.

New here? Run `accelerate-neuron demo`, then `accelerate-neuron env`."""

EPILOG = "Run `accelerate-neuron COMMAND --help` for a command's options."


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from . import cache, demo, env, precompile, simulate

    parser = ArgumentParser(
        prog="accelerate-neuron",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"accelerate-neuron {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command_name")
    demo.add_parser(subparsers)
    env.add_parser(subparsers)
    simulate.add_parser(subparsers)
    precompile.add_parser(subparsers)
    cache.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``accelerate-neuron`` console script; returns the exit code."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        # Name the subcommand in the error, with its usage, not only the top-level one.
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extras)}")
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.run(args))
    except CliError as exc:
        print(f"accelerate-neuron: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("accelerate-neuron: interrupted", file=sys.stderr)
        return 130
    except Terminated as exc:
        print(
            f"accelerate-neuron: terminated (signal {exc.signum}); the processes it started were ended", file=sys.stderr
        )
        return 128 + exc.signum


if __name__ == "__main__":
    sys.exit(main())
