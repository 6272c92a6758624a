"""Transport security and credentials for every gRPC server and channel of a cluster.

- **TLS** (``tls_cert``/``tls_key``, verified against ``tls_ca``) on the shard servers, the scheduler, the
  replication streams between servers, and every client; **mutual TLS** with ``require_client_cert``.
- **Tokens**: a caller sends ``authorization: Bearer <token>``; an interceptor compares it (constant time) with
  the trainer and admin tokens before any handler runs. A trainer may call ``TRAINER_METHODS`` (create tables,
  pull, push, follow the map); every other method (drop, snapshot, restore, map installs, replication, slot
  copies, checkpoints, moves, drains, rebalances, registering as a server, ending a hand-over, and any method
  added later) needs the admin token, which the servers and the scheduler also use to call each other. Rejected calls answer UNAUTHENTICATED or PERMISSION_DENIED and are counted; no token is
  ever logged.
- Token files hold one token per line, each optionally with ``expires=<ISO 8601 time>``; servers re-read them
  when they change, so tokens rotate without a restart, and an expired token answers UNAUTHENTICATED.
- A token needs TLS: without it, tokens are refused unless ``allow_insecure`` is set, and then only on
  loopback (gRPC local credentials: the server accepts connections from this machine only).

Health and reflection need no credential (a load balancer probes them).
"""

from __future__ import annotations

import datetime
import hmac
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tigana.ps.errors import InvalidArgument

__all__ = ["TRAINER_METHODS", "Security", "SecuritySettings", "Token", "TokenBook", "read_token", "read_tokens",
           "role_needed"]

AUTH_KEY = "authorization"
# The methods a trainer's credential may call: what a trainer, a serving client or an operator's read does.
# Every other method needs the admin credential, so an RPC added without a role lands closed.
# ReportUnreachable is here because clients send it when a server does not answer: it only makes the scheduler
# probe that server itself (``scheduler.liveness``); what the probe finds, never the report, declares a server
# dead. HandoverReady is not: it ends a primary hand-over, which only the old primary may say it has drained.
TRAINER_METHODS = frozenset({
    "/tigana.v1.Shard/CreateTable", "/tigana.v1.Shard/DescribeTable", "/tigana.v1.Shard/ListTables",
    "/tigana.v1.Shard/Pull", "/tigana.v1.Shard/Push", "/tigana.v1.Shard/Exchange", "/tigana.v1.Shard/Stats",
    "/tigana.v1.Scheduler/GetMap", "/tigana.v1.Scheduler/ReportUnreachable", "/tigana.v1.Scheduler/CreateTable",
    "/tigana.v1.Scheduler/ListTables", "/tigana.v1.Scheduler/Status",
    "/tigana.v1.Serving/Lookup", "/tigana.v1.Serving/Info", "/tigana.v1.Serving/Predict",
})
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def role_needed(method: str) -> str:
    """The credential a call of ``method`` ("/package.Service/Method") needs: "none" (health, reflection),
    "trainer" (``TRAINER_METHODS``; an admin's is accepted too) or "admin" (every other method)."""
    if method.startswith(_OPEN_PREFIXES):
        return "none"
    return "trainer" if method in TRAINER_METHODS else "admin"


@dataclass(frozen=True)
class Token:
    """One accepted credential: its value and, optionally, when it stops being accepted (Unix seconds)."""

    value: str = field(repr=False)
    expires: float | None = None


def read_tokens(path: str | os.PathLike) -> list[Token]:
    """The tokens of a token file: one per line, optionally followed by ``expires=<ISO 8601 time>`` (UTC
    unless it names a zone); blank lines and ``#`` comments are skipped. Several lines let an operator
    rotate a token: add the new one, move clients over, let the old one expire. ``InvalidArgument`` names
    the file and line (never a token) when the file cannot be read, is empty or a line is malformed."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidArgument(f"token file {str(path)!r}: cannot read: {exc.strerror}") from None
    tokens = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        expires = None
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key != "expires" or not value:
                raise InvalidArgument(f"token file {str(path)!r} line {n}: expected '<token> [expires=<time>]'")
            try:
                when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                raise InvalidArgument(f"token file {str(path)!r} line {n}: 'expires' is not an ISO 8601 time") from None
            if when.tzinfo is None:
                when = when.replace(tzinfo=datetime.timezone.utc)
            expires = when.timestamp()
        tokens.append(Token(words[0], expires))
    if not tokens:
        raise InvalidArgument(f"token file {str(path)!r} is empty")
    return tokens


def read_token(path: str | os.PathLike | None) -> str | None:
    """The token a process sends: the first one of the file not yet expired (``InvalidArgument`` naming the
    file when every one has)."""
    if not path:
        return None
    now = time.time()
    for token in read_tokens(path):
        if token.expires is None or token.expires > now:
            return token.value
    raise InvalidArgument(f"token file {str(path)!r}: every token in it has expired")


class TokenBook:
    """What a server accepts, by role: tokens given directly plus those of token files, re-read when a file
    changes (checked at most once a second), so tokens rotate without a restart."""

    def __init__(self, trainer: Sequence[Token] = (), admin: Sequence[Token] = (),
                 trainer_files: Sequence[str] = (), admin_files: Sequence[str] = ()) -> None:
        self._fixed = {"trainer": list(trainer), "admin": list(admin)}
        self._files = {"trainer": [str(f) for f in trainer_files if f], "admin": [str(f) for f in admin_files if f]}
        self._lock = threading.Lock()
        self._stamp: tuple = ()
        self._checked = 0.0
        self._entries: dict[str, list[tuple[bytes, float | None]]] = {}
        self._reload(force=True)

    def __bool__(self) -> bool:
        return any(self._entries.values())

    def _reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < 1.0:
            return
        with self._lock:
            self._checked = now
            stamp = tuple(_mtime(f) for role in ("trainer", "admin") for f in self._files[role])
            if stamp == self._stamp and not force:
                return
            try:
                entries = {role: [(t.value.encode(), t.expires)
                                  for t in [*self._fixed[role], *(t for f in self._files[role] for t in read_tokens(f))]]
                           for role in ("trainer", "admin")}
            except InvalidArgument:
                if force:
                    raise
                return  # a file being rewritten: keep what was accepted, look again next time
            self._entries, self._stamp = entries, stamp

    def check(self, presented: bytes) -> tuple[str | None, str]:
        """(role, reason): role "admin", "trainer" or None; reason "invalid" or "expired" when None.
        Every token is compared (constant time each, no early exit), so timing tells nothing."""
        self._reload()
        now = time.time()
        found: dict[str, list[float | None]] = {"admin": [], "trainer": []}
        for role, entries in self._entries.items():
            for value, expires in entries:
                if hmac.compare_digest(presented, value):
                    found[role].append(expires)
        for role in ("admin", "trainer"):
            if any(e is None or e > now for e in found[role]):
                return role, ""
        return None, "expired" if found["admin"] or found["trainer"] else "invalid"


def _mtime(path: str) -> tuple[float, int]:
    try:
        st = os.stat(path)
        return st.st_mtime, st.st_size
    except OSError:
        return 0.0, -1


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{what} {str(path)!r}: cannot read: {exc.strerror}") from None


@dataclass(frozen=True)
class Security:
    """The TLS material and credentials of one process. The default is no security (plain loopback use).

    tls_cert/tls_key: this process's certificate and key (PEM files; a server needs them for TLS, a client
    for mutual TLS); tls_ca: the CA that signed the peers' certificates; require_client_cert: servers demand
    and verify a client certificate. token: the credential this process sends. trainer_tokens/admin_tokens:
    what a server accepts, by role. allow_insecure: tokens over plaintext, loopback only."""

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    require_client_cert: bool = False
    token: str | None = field(default=None, repr=False)
    trainer_tokens: frozenset[str] = field(default=frozenset(), repr=False)
    admin_tokens: frozenset[str] = field(default=frozenset(), repr=False)
    allow_insecure: bool = False
    trainer_token_files: tuple[str, ...] = ()
    admin_token_files: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("security: field 'tls_cert' and 'tls_key' go together")
        if self.require_client_cert and not (self.tls_ca and self.tls_cert):
            raise InvalidArgument("security: field 'require_client_cert' needs 'tls_ca' and a server certificate")
        if self.uses_tokens and not self.tls and not self.allow_insecure:
            raise InvalidArgument("security: tokens need TLS (give --tls-cert/--tls-key, or --tls-ca for a client), "
                                  "or allow them in plaintext on loopback only with --allow-insecure-loopback")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)

    @property
    def uses_tokens(self) -> bool:
        return bool(self.token or self.trainer_tokens or self.admin_tokens or self.trainer_token_files
                    or self.admin_token_files)

    def token_book(self) -> TokenBook:
        """What this server accepts (the token files re-read when they change)."""
        return TokenBook([Token(t) for t in sorted(self.trainer_tokens)], [Token(t) for t in sorted(self.admin_tokens)],
                         self.trainer_token_files, self.admin_token_files)

    @property
    def enabled(self) -> bool:
        return self.tls or self.uses_tokens

    @classmethod
    def of_files(cls, *, tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
                 require_client_cert: bool = False, token_file: str | None = None,
                 trainer_token_files: Sequence[str | None] = (), admin_token_files: Sequence[str | None] = (),
                 allow_insecure: bool = False) -> Security:
        """A server accepts the tokens of ``trainer_token_files``/``admin_token_files`` (re-read when they change;
        see ``read_tokens``); this process sends the token of ``token_file``, or else the first valid one of the
        first admin file. Unreadable files raise ``InvalidArgument`` now, not at the first call."""
        admin_files = tuple(str(p) for p in admin_token_files if p)
        trainer_files = tuple(str(p) for p in trainer_token_files if p)
        for path in (*admin_files, *trainer_files):
            read_tokens(path)
        token = read_token(token_file) if token_file else (read_token(admin_files[0]) if admin_files else None)
        return cls(tls_cert, tls_key, tls_ca, require_client_cert, token, allow_insecure=allow_insecure,
                   trainer_token_files=trainer_files, admin_token_files=admin_files)

    # --- servers -----------------------------------------------------------------------------------------
    def add_port(self, server: grpc.Server, target: str) -> int:
        """Bind ``target`` with TLS, with loopback-only local credentials, or plainly; returns the port (0 when
        it could not bind)."""
        if self.tls_cert:
            creds = grpc.ssl_server_credentials(
                [(_read(self.tls_key, "TLS key"), _read(self.tls_cert, "TLS certificate"))],
                root_certificates=_read(self.tls_ca, "TLS CA"), require_client_auth=self.require_client_cert)
            return server.add_secure_port(target, creds)
        if self.uses_tokens:  # allow_insecure: only connections from this machine
            return server.add_secure_port(target, grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP))
        return server.add_insecure_port(target)

    def interceptors(self, on_reject: Callable[[str, str], None] | None = None) -> list[grpc.ServerInterceptor]:
        """The token check (none when no token is configured)."""
        book = self.token_book()
        if not book:
            return []
        return [_TokenInterceptor(book, on_reject)]

    # --- clients -----------------------------------------------------------------------------------------
    def channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A channel to ``address`` with this process's TLS and token (plain when there is neither)."""
        options = list(options)
        call = grpc.metadata_call_credentials(_TokenPlugin(self.token)) if self.token else None
        if self.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=_read(self.tls_ca, "TLS CA"),
                                                 private_key=_read(self.tls_key, "TLS key"),
                                                 certificate_chain=_read(self.tls_cert, "TLS certificate"))
            if call is not None:
                creds = grpc.composite_channel_credentials(creds, call)
            return grpc.secure_channel(address, creds, options=options)
        if call is not None:  # allow_insecure: plaintext, loopback only
            creds = grpc.composite_channel_credentials(
                grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP), call)
            return grpc.secure_channel(address, creds, options=options)
        return grpc.insecure_channel(address, options=options)


NONE = Security()


class _TokenPlugin(grpc.AuthMetadataPlugin):
    def __init__(self, token: str) -> None:
        self._value = f"Bearer {token}"

    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        callback(((AUTH_KEY, self._value),), None)

    def __repr__(self) -> str:  # never show the token
        return "_TokenPlugin(<redacted>)"


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def handler(request: object, context: grpc.ServicerContext) -> None:
        context.abort(code, message)
    return grpc.unary_unary_rpc_method_handler(handler, request_deserializer=lambda raw: raw)


class _TokenInterceptor(grpc.ServerInterceptor):
    """Checks the bearer token and the role before any handler runs."""

    def __init__(self, book: TokenBook, on_reject: Callable[[str, str], None] | None) -> None:
        self._book = book
        self._on_reject = on_reject

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        needed = role_needed(method)
        if needed == "none":
            return continuation(handler_call_details)
        value = ""
        for key, v in handler_call_details.invocation_metadata or ():
            if key == AUTH_KEY:
                value = v if isinstance(v, str) else v.decode("latin-1")
        if not value.startswith("Bearer "):
            return self._reject(method, "missing", grpc.StatusCode.UNAUTHENTICATED,
                                f"{method}: no credential (send authorization: Bearer <token>)")
        role, why = self._book.check(value[7:].encode())
        if role is None:
            return self._reject(method, why, grpc.StatusCode.UNAUTHENTICATED,
                                f"{method}: credential {'expired' if why == 'expired' else 'refused'}")
        if role != "admin" and needed == "admin":
            return self._reject(method, "role", grpc.StatusCode.PERMISSION_DENIED,
                                f"{method}: needs the admin credential")
        return continuation(handler_call_details)

    def _reject(self, method: str, reason: str, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
        if self._on_reject is not None:
            self._on_reject(method, reason)
        return _deny(code, message)


@dataclass(frozen=True)
class SecuritySettings:
    """The TLS and token settings every daemon takes (the server's and the scheduler's configs extend it):
    ``tls_cert``/``tls_key`` serve TLS, ``tls_ca`` verifies peers (and, with ``require_client_cert``, callers'
    certificates), ``auth_token_file`` holds the trainers' tokens, ``admin_token_file`` the admin tokens (which
    the daemon also presents to its peers); tokens need TLS unless ``allow_insecure_loopback``."""

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    require_client_cert: bool = False
    auth_token_file: str | None = None
    admin_token_file: str | None = None
    allow_insecure_loopback: bool = False

    def security(self) -> Security:
        """TLS material and tokens, read from their files (``InvalidArgument`` naming a file that cannot be)."""
        return Security.of_files(tls_cert=self.tls_cert, tls_key=self.tls_key, tls_ca=self.tls_ca,
                                 require_client_cert=self.require_client_cert,
                                 trainer_token_files=[self.auth_token_file], admin_token_files=[self.admin_token_file],
                                 allow_insecure=self.allow_insecure_loopback)
