"""python -m specdec_client.probe ADDRESS [SERVICE] — one grpc.health.v1 Check, for container
health checks and scripts (no downloaded probe binary needed).

SERVICE "" (the default) asks about the server as a whole (liveness); a service's full name,
e.g. ``specdec.v1.Orchestrator``, asks whether that service is ready (readiness).
Prints the status and exits 0 for SERVING, 1 for any other answer (NOT_SERVING, UNKNOWN, or a
service the server does not know), 2 when the server cannot be reached in time.
"""
from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.security import channel_credentials, secure_or_insecure

SERVING, NOT_READY, UNREACHABLE = 0, 1, 2


def check(address: str, service: str = "", timeout: float = 2.0,
          credentials: grpc.ChannelCredentials | None = None) -> str:
    """The health status name of ``service`` at ``address`` ("SERVING", "NOT_SERVING", …),
    "NOT_FOUND" for a service the server does not know, "UNREACHABLE" if no answer came.
    ``credentials``: TLS (``serving.security.channel_credentials``); None = plain text."""
    return check_verbose(address, service, timeout, credentials)[0]


def check_verbose(address: str, service: str = "", timeout: float = 2.0,
                  credentials: grpc.ChannelCredentials | None = None) -> tuple[str, str]:
    """``check``'s status and, when no answer came, the call's error ("" otherwise)."""
    # its own connection (not one shared with other channels of this process): a sharded
    # orchestrator's shards (serving.shards) are each reached by the connections the kernel gives them
    with secure_or_insecure(False, address, credentials, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return "NOT_FOUND", ""
            return "UNREACHABLE", f"{e.code().name}: {e.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status), ""


TLS_HINT = "(the server may require TLS: --tls-ca)"


def tls_hint(details: str, tls: bool) -> str:
    """``TLS_HINT`` after ``details`` when a plain-text connection failed the way it fails to a
    TLS port ("failed to connect to all addresses; … Socket closed"), else ``details`` as it is
    (a worker's error relayed by the orchestrator does not get it)."""
    if not tls and "failed to connect" in (details or "") and "Socket closed" in details:
        return f"{details} {TLS_HINT}"
    return details


def add_tls_flags(p) -> None:
    """--tls, --tls-ca, --tls-cert, --tls-key (client side; ``SPECDEC_CLIENT_TLS_*``), shared
    with the client CLI."""
    env = os.environ.get
    p.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    p.add_argument("--tls-ca", default=env("SPECDEC_CLIENT_TLS_CA", ""),
                   help="PEM CA that signed the server's certificate (turns TLS on)")
    p.add_argument("--tls-cert", default=env("SPECDEC_CLIENT_TLS_CERT", ""),
                   help="PEM client certificate for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", default=env("SPECDEC_CLIENT_TLS_KEY", ""), help="PEM key of --tls-cert")


def exit_code(status: str) -> int:
    """0 for SERVING, 2 for UNREACHABLE, 1 otherwise."""
    return {"SERVING": SERVING, "UNREACHABLE": UNREACHABLE}.get(status, NOT_READY)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec_client.probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address", help="host:port of the service")
    p.add_argument("service", nargs="?", default="", help='full service name; "" = the whole server')
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    add_tls_flags(p)
    args = p.parse_args(argv)
    creds = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key, args.tls)
    status, error = check_verbose(args.address, args.service, args.timeout, creds)
    print(status)
    if error:
        print(tls_hint(error, creds is not None), file=sys.stderr)
    return exit_code(status)


if __name__ == "__main__":
    sys.exit(main())
