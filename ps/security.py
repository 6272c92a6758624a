"""Transport security and credentials for every gRPC server and channel of a cluster.

- **TLS** (``tls_cert``/``tls_key``, verified against ``tls_ca``) on the shard servers, the scheduler, the
  replication streams between servers, and every client; **mutual TLS** with ``require_client_cert``.
- **Tokens**: a caller sends ``authorization: Bearer <token>``; an interceptor compares it (constant time) with
  the trainer and admin tokens before any handler runs. A trainer may create tables, pull and push; admin
  operations (drop, snapshot, restore, map installs, replication, slot copies, checkpoints, moves, drains,
  rebalances, registering as a server) need the admin token, which the servers and the scheduler also use to
  call each other. Rejected calls answer UNAUTHENTICATED or PERMISSION_DENIED and are counted; no token is
  ever logged.
- A token needs TLS: without it, tokens are refused unless ``allow_insecure`` is set, and then only on
  loopback (gRPC local credentials: the server accepts connections from this machine only).

Health and reflection need no credential (a load balancer probes them).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tigana.ps.errors import InvalidArgument

__all__ = ["ADMIN_METHODS", "Security", "read_token"]

AUTH_KEY = "authorization"
# Methods that need the admin credential; every other method of the two services takes a trainer's too.
ADMIN_METHODS = frozenset({
    "/tigana.v1.Shard/DropTable", "/tigana.v1.Shard/Snapshot", "/tigana.v1.Shard/Restore",
    "/tigana.v1.Shard/InstallMap", "/tigana.v1.Shard/Replicate", "/tigana.v1.Shard/SlotInfo",
    "/tigana.v1.Shard/ExportRows", "/tigana.v1.Shard/ImportRows",
    "/tigana.v1.Scheduler/Register", "/tigana.v1.Scheduler/Heartbeat", "/tigana.v1.Scheduler/ReportCopyFailure",
    "/tigana.v1.Scheduler/CopyCaughtUp", "/tigana.v1.Scheduler/DropTable", "/tigana.v1.Scheduler/MoveSlot",
    "/tigana.v1.Scheduler/Drain", "/tigana.v1.Scheduler/Rebalance",
})
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def read_token(path: str | os.PathLike | None) -> str | None:
    """The token in a file (surrounding whitespace stripped); ``InvalidArgument`` naming the file (never its
    contents) when it cannot be read or is empty."""
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise InvalidArgument(f"token file {str(path)!r}: cannot read: {exc.strerror}") from None
    if not token:
        raise InvalidArgument(f"token file {str(path)!r} is empty")
    return token


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
        return bool(self.token or self.trainer_tokens or self.admin_tokens)

    @property
    def enabled(self) -> bool:
        return self.tls or self.uses_tokens

    @classmethod
    def of_files(cls, *, tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
                 require_client_cert: bool = False, token_file: str | None = None,
                 trainer_token_files: Sequence[str | None] = (), admin_token_files: Sequence[str | None] = (),
                 allow_insecure: bool = False) -> Security:
        """Read the token files (the first admin token is also what this process sends, unless
        ``token_file`` names another)."""
        admin = frozenset(t for t in (read_token(p) for p in admin_token_files) if t)
        trainer = frozenset(t for t in (read_token(p) for p in trainer_token_files) if t)
        token = read_token(token_file) if token_file else (next(iter(sorted(admin)), None))
        return cls(tls_cert, tls_key, tls_ca, require_client_cert, token, trainer, admin, allow_insecure)

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
        if not (self.trainer_tokens or self.admin_tokens):
            return []
        return [_TokenInterceptor(self.trainer_tokens, self.admin_tokens, on_reject)]

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

    def __init__(self, trainer: frozenset[str], admin: frozenset[str],
                 on_reject: Callable[[str, str], None] | None) -> None:
        self._trainer = [t.encode() for t in trainer]
        self._admin = [t.encode() for t in admin]
        self._on_reject = on_reject

    def _role(self, presented: bytes) -> str | None:
        # Compare against every token (constant time each, no early exit), so timing tells nothing.
        admin = any([hmac.compare_digest(presented, t) for t in self._admin])
        trainer = any([hmac.compare_digest(presented, t) for t in self._trainer])
        return "admin" if admin else ("trainer" if trainer else None)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_OPEN_PREFIXES):
            return continuation(handler_call_details)
        value = ""
        for key, v in handler_call_details.invocation_metadata or ():
            if key == AUTH_KEY:
                value = v if isinstance(v, str) else v.decode("latin-1")
        if not value.startswith("Bearer "):
            return self._reject(method, "missing", grpc.StatusCode.UNAUTHENTICATED,
                                f"{method}: no credential (send authorization: Bearer <token>)")
        role = self._role(value[7:].encode())
        if role is None:
            return self._reject(method, "invalid", grpc.StatusCode.UNAUTHENTICATED, f"{method}: credential refused")
        if role != "admin" and method in ADMIN_METHODS:
            return self._reject(method, "role", grpc.StatusCode.PERMISSION_DENIED,
                                f"{method}: needs the admin credential")
        return continuation(handler_call_details)

    def _reject(self, method: str, reason: str, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
        if self._on_reject is not None:
            self._on_reject(method, reason)
        return _deny(code, message)
