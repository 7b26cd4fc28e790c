"""TLS, mutual TLS and the bearer token (issue 11, item 5; ``serving.security``), on real gRPC
servers with throwaway certificates made here (``cryptography``).

Fast tier: the target and draft services over the session's engines and the orchestrator in
front of them, each started as ``serving.launch.serve`` starts it (flags parsed by the
services' own ``parse_args``, the host built with ``security.server_interceptors`` and bound
with ``security.server_credentials_from``), in this process on loopback: the workers serve
mutual TLS, the orchestrator TLS + a bearer token. A TLS client with the token generates the
autoregressive output; a plain-text client, a missing or wrong token, and a worker client
without the orchestrator's certificate are all refused. Slow tier: the same with three
separate processes (``deploy.local``).
"""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import threading
from pathlib import Path

import grpc
import pytest

from specdec_client import SpecDecClient, SpecDecError
from specdec_client.probe import check

x509 = pytest.importorskip("cryptography.x509", reason="the test certificates are made with `cryptography`")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

TOKEN = "s3cret-token"
ORCH = "specdec.v1.Orchestrator"
PROMPT = dict(messages=[{"role": "user", "content": "Name three colours."}], max_tokens=12, ignore_eos=True)


def _name(cn: str):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key, issuer_name, issuer_key, *, ca: bool = False, server: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
    if not ca:
        b = b.add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), False)
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(folder: Path) -> dict[str, str]:
    """PEM files in ``folder``: ca, server (cert/key, for localhost and 127.0.0.1), client
    (cert/key, signed by ca) and rogue_client (cert/key signed by another CA). Returns name → path."""
    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def write(name: str, data: bytes) -> str:
        path = folder / name
        path.write_bytes(data)
        return str(path)

    files = {}
    for ca_name, certs in (("ca", ("server", "client")), ("rogue_ca", ("rogue_client",))):
        ca_key = key()
        ca_cert = _issue(ca_name, ca_key, _name(ca_name), ca_key, ca=True)
        files[ca_name] = write(f"{ca_name}.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
        for who in certs:
            k = key()
            cert = _issue(who, k, ca_cert.subject, ca_key, server=who == "server")
            files[f"{who}_cert"] = write(f"{who}.pem", cert.public_bytes(serialization.Encoding.PEM))
            files[f"{who}_key"] = write(f"{who}.key", k.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return files


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _serve(te, de, pki: dict[str, str]):
    """Workers with mutual TLS, the orchestrator with TLS + ``TOKEN``: flags → host → bind, as
    ``serving.launch.serve`` does; returns (hosts, addresses)."""
    import structlog

    import draft_service.__main__ as draft_main
    import orchestrator.__main__ as orchestrator_main
    import target_service.__main__ as target_main
    from serving import security
    from serving.server import ServiceHost

    server_tls = ["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"]]
    worker_args = server_tls + ["--tls-client-ca", pki["ca"]]
    hosts, addresses = {}, {}
    for name, main, engine in (("target", target_main, te), ("draft", draft_main, de)):
        args = main.parse_args(worker_args)
        hosts[name] = ServiceHost([main.ROLE.service], interceptors=security.server_interceptors(args))
        main.register(hosts[name], {"engine": engine})
        port = await hosts[name].start("127.0.0.1:0", security.server_credentials_from(args))
        await hosts[name].set_status(True)
        addresses[name] = f"127.0.0.1:{port}"
    args = orchestrator_main.parse_args(server_tls + [
        "--target", addresses["target"], "--draft", addresses["draft"], "--auth-token", TOKEN,
        "--worker-tls-ca", pki["ca"], "--worker-tls-cert", pki["client_cert"], "--worker-tls-key", pki["client_key"]])
    host = hosts["orchestrator"] = ServiceHost([ORCH], interceptors=security.server_interceptors(args))
    state: dict = {}
    orchestrator_main.register(host, state)
    addresses["orchestrator"] = f"127.0.0.1:{await host.start('127.0.0.1:0', security.server_credentials_from(args))}"
    load_and_warm, warm_async = await orchestrator_main.prepare(args, host, state, structlog.get_logger())
    await asyncio.to_thread(load_and_warm)
    await warm_async()
    await host.set_status(True)
    return hosts, addresses


@pytest.fixture(scope="module")
def secure(engines, pki):
    """Addresses of the three TLS services (in this process, one event loop thread)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="tls-servers")
    thread.start()
    hosts, addresses = asyncio.run_coroutine_threadsafe(_serve(*engines, pki), loop).result(120)
    try:
        yield addresses
    finally:
        async def down():
            for h in hosts.values():
                await h.server.stop(grace=None)
        asyncio.run_coroutine_threadsafe(down(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def creds(pki, who: str | None = None, ca: str = "ca"):
    from serving.security import channel_credentials

    return channel_credentials(pki[ca], pki[f"{who}_cert"] if who else "", pki[f"{who}_key"] if who else "")


def test_tls_stack_generates_with_the_token(secure, pki, engines):
    with SpecDecClient(secure["orchestrator"], timeout=120, tls_ca=pki["ca"], token=TOKEN) as c:
        want = c.generate(**PROMPT, mode="autoregressive")
        got = c.generate(**PROMPT, mode="tree", tree_budget=8)
    assert got.completion_tokens == 12 and got.token_ids == want.token_ids and got.text
    assert got.stats.fallback_rounds == 0  # the drafter answered over mutual TLS
    te, de = engines
    assert (te.live_requests, de.live_requests) == (0, 0)


def test_plain_text_client_is_refused_by_a_tls_server(secure):
    with SpecDecClient(secure["orchestrator"], timeout=10, token=TOKEN) as c, pytest.raises(SpecDecError) as e:
        c.generate(**PROMPT)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert check(secure["orchestrator"], ORCH, timeout=2) == "UNREACHABLE"


def test_plain_text_cli_and_probe_hint_at_tls(secure, capsys):
    """The client CLI and the probe, run without TLS flags against a TLS port, say the server
    may require TLS (the bare error is "Socket closed")."""
    from specdec_client.__main__ import main as cli
    from specdec_client.probe import TLS_HINT, main as probe

    assert cli(["hi", "--address", secure["orchestrator"], "--timeout", "10", "--max-tokens", "2"]) == 1
    assert TLS_HINT in capsys.readouterr().err
    assert probe([secure["orchestrator"]]) == 2
    assert TLS_HINT in capsys.readouterr().err


@pytest.mark.parametrize("token", ["", "wrong-token", TOKEN + "x"])
def test_missing_or_wrong_token_is_unauthenticated(secure, pki, token):
    with SpecDecClient(secure["orchestrator"], timeout=10, tls_ca=pki["ca"], token=token) as c, \
            pytest.raises(SpecDecError) as e:
        c.generate(**PROMPT)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert ("missing" if not token else "wrong") in e.value.details


def test_health_checks_need_tls_but_no_token(secure, pki):
    assert check(secure["orchestrator"], ORCH, credentials=creds(pki)) == "SERVING"


def test_workers_accept_only_the_orchestrators_client_certificate(secure, pki):
    """Mutual TLS: a worker answers a client holding a certificate from the CA it trusts, and
    refuses plain text, TLS without a client certificate and one from another CA."""
    for name in ("target", "draft"):
        address = secure[name]
        assert check(address, credentials=creds(pki, "client")) == "SERVING"
        assert check(address, timeout=1) == "UNREACHABLE"  # plain text
        assert check(address, timeout=1, credentials=creds(pki)) == "UNREACHABLE"  # no client certificate
        assert check(address, timeout=1, credentials=creds(pki, "rogue_client")) == "UNREACHABLE"


def test_cli_flags(secure, pki, capsys):
    from specdec_client.__main__ import main

    base = ["Name three colours.", "--address", secure["orchestrator"], "--max-tokens", "4", "--tls-ca", pki["ca"]]
    assert main(base + ["--token", TOKEN, "--json"]) == 0
    assert '"completion_tokens": 4' in capsys.readouterr().out
    assert main(base + ["--token", "nope", "--json"]) == 1
    assert '"UNAUTHENTICATED"' in capsys.readouterr().err


def test_half_a_key_pair_is_refused(pki):
    from serving.security import channel_credentials, server_credentials

    with pytest.raises(ValueError, match="--tls-key"):
        server_credentials(pki["server_cert"], "")
    with pytest.raises(ValueError, match="--tls-client-ca"):
        server_credentials("", "", pki["ca"])
    with pytest.raises(ValueError, match="go together"):
        channel_credentials(pki["ca"], pki["client_cert"], "")



def test_unreadable_tls_file_is_one_error_line(tmp_path, capsys):
    """A missing CA/cert file: the CLI prints one error naming the path and exits 2, and a
    service logs it and exits 1 (break test: both used to end in a traceback)."""
    from serving.security import CredentialsError, server_credentials
    from specdec_client.__main__ import main

    missing = str(tmp_path / "missing.pem")
    assert main(["hello", "--tls-ca", missing]) == 2
    assert f"cannot read TLS file {missing}: No such file or directory" in capsys.readouterr().err
    with pytest.raises(CredentialsError, match="missing.pem"):
        server_credentials(missing, missing)

@pytest.mark.slow
def test_tls_processes_generate(pki, tmp_path):
    """Three processes (``deploy.local``) with mutual TLS on the worker links and TLS + token on
    the public API, configured through SPECDEC_* environment variables."""
    from deploy.local import start_stack

    env = {"SPECDEC_TLS_CERT": pki["server_cert"], "SPECDEC_TLS_KEY": pki["server_key"],
           "SPECDEC_TLS_CLIENT_CA": pki["ca"], "SPECDEC_WORKER_TLS_CA": pki["ca"],
           "SPECDEC_WORKER_TLS_CERT": pki["client_cert"], "SPECDEC_WORKER_TLS_KEY": pki["client_key"],
           "SPECDEC_AUTH_TOKEN": TOKEN}
    stack = start_stack(env=env, log_dir=str(tmp_path / "logs"))
    stack.credentials = creds(pki, "client")  # the orchestrator also asks for a client certificate here
    try:
        stack.wait_serving()
        with SpecDecClient(stack.address, timeout=120, tls_ca=pki["ca"], tls_cert=pki["client_cert"],
                           tls_key=pki["client_key"], token=TOKEN) as c:
            want = c.generate(**PROMPT, mode="autoregressive")
            got = c.generate(**PROMPT, mode="tree", tree_budget=8)
        assert got.token_ids == want.token_ids and got.stats.fallback_rounds == 0
        with SpecDecClient(stack.address, timeout=10, tls_ca=pki["ca"], tls_cert=pki["client_cert"],
                           tls_key=pki["client_key"]) as c, pytest.raises(SpecDecError) as e:
            c.generate(**PROMPT)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stack.stop()
