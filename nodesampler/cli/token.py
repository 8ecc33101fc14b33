"""`nodesampler token NODE`: the token that lets one node speak for itself."""

from __future__ import annotations

import argparse

from nodesampler.cli.parser import EXIT_USAGE, fail


def cmd_token(args: argparse.Namespace) -> int:
    from controlplane.ingest.tokens import TokenError, node_token, read_secret

    try:
        print(node_token(read_secret(args.secret_file), args.node))
    except TokenError as e:
        fail(EXIT_USAGE, str(e))
    return 0
