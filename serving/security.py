"""Transport security, off by default: TLS or mutual TLS on every gRPC link and a bearer token
on the public API, all with gRPC's own credentials.

- Every service (``add_server_flags``): ``--tls-cert`` + ``--tls-key`` (PEM files) serve TLS
  only (no plain-text port); ``--tls-client-ca`` also requires a client certificate signed by
  that CA (mutual TLS: the workers then talk only to an orchestrator holding such a certificate).
- The orchestrator's worker links (``orchestrator.__main__``): ``--worker-tls-ca`` (the CA that
  signed the workers' certificates; turns TLS on), ``--worker-tls-cert`` / ``--worker-tls-key``
  (its client certificate for mutual TLS).
- The public API (orchestrator): ``--auth-token`` (better: ``SPECDEC_AUTH_TOKEN``) makes every
  call except grpc.health.v1 carry ``authorization: Bearer <token>``, else UNAUTHENTICATED
  (``TokenCheck``). The SDK and CLI send it (``bearer``); health probes stay open so that
  Kubernetes and compose can probe without the secret.

Every flag also reads ``SPECDEC_<FLAG>``. A certificate must name the host its clients dial
(subjectAltName: a DNS name or an IP address such as 127.0.0.1). The /metrics endpoint stays
plain HTTP. Functions raise OSError for an unreadable file and ValueError for half a pair.
"""
from __future__ import annotations

import hmac

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # answered without a token (probes)


class CredentialsError(ValueError):
    """A TLS file (certificate, key, CA) that cannot be read; the message names the path."""


def _read(path: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CredentialsError(f"cannot read TLS file {path}: {e.strerror}") from None


def add_server_flags(p) -> None:
    """--tls-cert, --tls-key, --tls-client-ca (each service)."""
    from serving.server import env_default as env

    p.add_argument("--tls-cert", default=env("tls_cert", ""),
                   help="PEM certificate chain: serve TLS only (with --tls-key); empty = plain text")
    p.add_argument("--tls-key", default=env("tls_key", ""), help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=env("tls_client_ca", ""),
                   help="PEM CA: also require a client certificate it signed (mutual TLS)")


def server_credentials(cert: str = "", key: str = "", client_ca: str = "") -> grpc.ServerCredentials | None:
    """Credentials for ``add_secure_port`` from PEM file paths; None (plain text) when ``cert``
    and ``key`` are empty. ``client_ca``: require and verify client certificates against it."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key go together")
    ca = _read(client_ca)
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def server_credentials_from(config) -> grpc.ServerCredentials | None:
    """``server_credentials`` from a service's parsed flags (absent flags: plain text)."""
    return server_credentials(getattr(config, "tls_cert", ""), getattr(config, "tls_key", ""),
                              getattr(config, "tls_client_ca", ""))


def channel_credentials(ca: str = "", cert: str = "", key: str = "", tls: bool = False) -> grpc.ChannelCredentials | None:
    """Client TLS from PEM file paths: verify the server against ``ca`` (empty: the system's
    roots), present ``cert``/``key`` for mutual TLS. None (plain text) unless ``tls`` or a file
    is given."""
    if not (tls or ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("a client certificate and its key go together")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


def secure_or_insecure(aio: bool, address: str, credentials: grpc.ChannelCredentials | None, options=None):
    """A channel (``grpc.aio`` when ``aio``) to ``address``: TLS with ``credentials``, else plain text."""
    mod = grpc.aio if aio else grpc
    if credentials is None:
        return mod.insecure_channel(address, options=options)
    return mod.secure_channel(address, credentials, options=options)


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (none for an empty one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <token>`` with UNAUTHENTICATED
    (compared in constant time), except ``OPEN_METHODS``."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self.expected):
            return handler
        why = "missing bearer token (metadata authorization: Bearer <token>)" if not got else "wrong bearer token"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
            yield  # (an async generator, as a streaming handler must be)

        codec = dict(request_deserializer=handler.request_deserializer,
                     response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(deny, **codec)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **codec)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(deny, **codec)
        return grpc.stream_stream_rpc_method_handler(deny_stream, **codec)


def server_interceptors(config) -> list[grpc.aio.ServerInterceptor]:
    """``[TokenCheck]`` when the service's flags set ``--auth-token``, else none."""
    token = getattr(config, "auth_token", "")
    return [TokenCheck(token)] if token else []
