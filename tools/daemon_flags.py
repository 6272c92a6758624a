"""Command-line flags every daemon (``tigana server``, ``scheduler``, ``serve``) spells the same way: TLS and
tokens, and the Prometheus endpoint. Defaults are None, so a config file or ``TIGANA_*`` variable can fill them."""

from __future__ import annotations

import argparse
import logging
import sys

from tigana.ps.logs import JsonFormatter


def add_security_flags(parser: argparse.ArgumentParser, who: str, admin_token: str) -> None:
    """``--tls-cert/--tls-key/--tls-ca/--require-client-cert/--auth-token-file/--admin-token-file/
    --allow-insecure-loopback``; ``who`` names the daemon in the help, ``admin_token`` says what that token does."""
    a = parser.add_argument
    a("--tls-cert", default=None, help=f"PEM certificate the {who} presents (TLS)")
    a("--tls-key", default=None, help="PEM private key of --tls-cert")
    a("--tls-ca", default=None, help="PEM CA that verifies peers (and client certificates)")
    a("--require-client-cert", action="store_const", const=True, default=None,
      help="mutual TLS: refuse callers without a certificate signed by --tls-ca")
    a("--auth-token-file", default=None, help="file with the trainers' tokens (one per line, optional expiry)")
    a("--admin-token-file", default=None, help=f"file with the admin tokens ({admin_token})")
    a("--allow-insecure-loopback", action="store_const", const=True, default=None,
      help="accept tokens without TLS, from this machine only")


def add_metrics_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """``--metrics-port`` (0 off, 'auto' a free port) and ``--metrics-host``; ``what`` lists what it exports."""
    parser.add_argument("--metrics-port", default=None, help=f"Prometheus HTTP port ({what}); 0 off, 'auto' a free port")
    parser.add_argument("--metrics-host", default=None, help="address the metrics endpoint binds (0.0.0.0: every "
                        "interface)")


def say(args: argparse.Namespace, text: str, level: int = logging.INFO) -> None:
    """A daemon's lifecycle line (serving on, stopping, a start-up error) on stderr: with ``--log-format json``
    a JSON object like every log record, so that every line of the log parses; else the text."""
    if getattr(args, "log_format", "text") == "json":
        record = logging.makeLogRecord({"name": "tigana.cli", "levelno": level,
                                        "levelname": logging.getLevelName(level), "msg": text})
        print(JsonFormatter().format(record), file=sys.stderr, flush=True)
    else:
        print(text, file=sys.stderr, flush=True)
