"""Serving entry point (OpenAI-compatible HTTP server) — not implemented yet.

The continuous-batching engine and HTTP API are tracked as their own piece of work; until
they land this script only prints usage so nobody mistakes it for a working server.
"""

import sys

USAGE = """usage: python serve.py [--target DIR] [--drafter DIR] [--scheduler MODE] [--slots N]
                       [--host HOST] [--port PORT] [--demo]

The serving engine is not implemented yet. For offline generation today use:
  python -m dspark_jax.generate --help
"""


def main(argv=None) -> int:
    sys.stdout.write(USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main())
