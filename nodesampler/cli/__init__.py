"""The `nodesampler` command.

Every misuse is one line on stderr and exit code 2; a backend that was asked
for and cannot run is exit code 3 with the reason. One module a command
(`sample`, `up`, `agent`, `controlplane`, `token`, `forget`, `kube-secrets`), the flags of
all in `parser`.
"""

from __future__ import annotations

import logging
import os
import sys

from nodesampler.cli.agent import cmd_agent
from nodesampler.cli.controlplane import cmd_controlplane
from nodesampler.cli.forget import cmd_forget
from nodesampler.cli.kube_secrets import cmd_kube_secrets
from nodesampler.cli.parser import build_parser
from nodesampler.cli.sample import cmd_sample
from nodesampler.cli.token import cmd_token
from nodesampler.cli.up import cmd_up

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="nodesampler: %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    commands = {"sample": cmd_sample, "up": cmd_up, "agent": cmd_agent, "controlplane": cmd_controlplane,
                "token": cmd_token, "forget": cmd_forget, "kube-secrets": cmd_kube_secrets}  # fmt: skip
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say, and no traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

