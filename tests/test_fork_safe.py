"""A forked child never touches the parent's connections to an async store (fsspec's HTTP
filesystem, s3fs): cachemw/tiers/fork_safe.py. The DataLoader case (a worker dropping
the parent's filesystem; the parent's next request hung for its timeout) is in
test_cache_torch.py; here, the closing of inherited connections in a child, over TLS."""
from __future__ import annotations

import datetime
import http.server
import os
import socketserver
import ssl
import threading

import fsspec
import pytest


def _self_signed(tmp_path):
    """A certificate and key for 127.0.0.1, made here."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")


@pytest.mark.timeout(60)
def test_a_forked_child_closing_inherited_connections_leaves_the_parent_s_tls_connection(tmp_path):
    """The child closing what it inherited (fsspec's finalizer of a dropped instance) sent
    the server a TLS close_notify on the socket it shares with the parent, ending the
    parent's keep-alive connection (found by a review of the fork guard); the parent's
    next request then needed a new connection, or failed if one was under way."""
    import cachemw.client.fs  # noqa: F401 - a process reading through cachemw has the guard

    ports = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def do_GET(self):
            ports.append(self.client_address[1])
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b"x" * 100)

        def log_message(self, *args):
            pass

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*_self_signed(tmp_path))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"https://127.0.0.1:{server.server_address[1]}/f"
        fs = fsspec.filesystem("https", ssl=False, skip_instance_cache=True)
        assert fs.cat(url) == b"x" * 100
        pid = os.fork()
        if pid == 0:  # what the finalizer of the parent's instance does in a child
            try:
                fs.close_session(fs._loop, fs._session)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert fs.cat(url) == b"x" * 100
        assert ports[0] == ports[1]  # the same connection: the child left it alone
    finally:
        server.shutdown()
