"""A real S3-compatible server for tests: moto's standalone `moto_server` in its own process,
over http or over TLS with a certificate signed by a CA made here, with moto's request recorder
on, so a test can count the GETs of shard objects the server actually answered.

`moto_server` and `cryptography` are imported directly (the dev extra's moto[server]): a missing
one fails the test module under CI=true, never skips it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import moto.server  # noqa: F401  (the server's own package: fail here when it is missing)
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "hpcml-test",
    "AWS_SECRET_ACCESS_KEY": "hpcml-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Never ask an instance-metadata service for credentials from a test.
    "AWS_EC2_METADATA_DISABLED": "true",
}


def make_ca_and_server_cert(folder: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate it signs for 127.0.0.1 and localhost:
    (ca.pem, server.pem, server.key)."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hpcml test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    ca_pem, cert_pem, key_pem = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_pem, cert_pem, key_pem


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """`moto_server` on 127.0.0.1 in a child process; `tls=(cert, key, ca)` serves https."""

    def __init__(self, folder: Path, tls: tuple[Path, Path, Path] | None = None) -> None:
        import shutil
        import sys

        exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
        self.port = _free_port()
        self.scheme = "https" if tls else "http"
        self.recording = folder / "moto-requests.jsonl"
        self.log = open(folder / "moto-server.log", "wb")  # noqa: SIM115 (closed in stop)
        cmd = [exe, "-H", "127.0.0.1", "-p", str(self.port)]
        if tls is not None:
            cmd += ["--ssl", "-c", str(tls[0]), "-k", str(tls[1])]
        env = {**os.environ, "MOTO_RECORDER_FILEPATH": str(self.recording)}
        env.pop("MOTO_ENABLE_RECORDING", None)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.context = ssl.create_default_context(cafile=str(tls[2])) if tls else None
        for _ in range(600):  # until it answers (moto's start is seconds on a busy machine)
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited {self.proc.returncode}; see {self.log.name}"
                )
            try:
                urllib.request.urlopen(
                    f"{self.url}/moto-api/data.json", context=self.context, timeout=2
                )
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto_server did not answer within 60 s")

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def put(self, path: str, data: bytes = b"") -> None:
        """A plain S3 PUT (a bucket, or an object in one). moto does not check signatures;
        pyarrow's own upload goes multipart, which this moto's standalone server answers
        with an empty CompleteMultipartUpload."""
        req = urllib.request.Request(
            f"{self.url}/{path}",
            data=data,
            method="PUT",
            headers={"Content-Type": "application/octet-stream"},
        )
        urllib.request.urlopen(req, context=self.context, timeout=30).read()

    def upload(self, local: Path, bucket: str, prefix: str) -> str:
        """Every file of folder `local` under s3://bucket/prefix; returns the data.path URL.
        The request recorder starts after the upload."""
        self.put(bucket)
        for f in sorted(local.iterdir()):
            self.put(f"{bucket}/{prefix}/{f.name}", f.read_bytes())
        self.record()
        return (
            f"s3://{bucket}/{prefix}?endpoint_override=127.0.0.1:{self.port}"
            f"&scheme={self.scheme}&region=us-east-1"
        )

    def record(self) -> None:
        """Start moto's request recorder (off while uploading: recording consumes the bodies of
        multipart uploads in this moto version)."""
        req = urllib.request.Request(f"{self.url}/moto-api/recorder/start-recording", method="POST")
        urllib.request.urlopen(req, context=self.context, timeout=10).read()

    def requests(self) -> list[tuple[str, str]]:
        """(method, path) of every request the server has answered, oldest first."""
        if not self.recording.exists():
            return []
        out = []
        for line in self.recording.read_text().splitlines():
            entry = json.loads(line)
            out.append((entry["method"], urlsplit(entry["url"]).path))
        return out

    def shard_gets(self, since: int = 0) -> list[str]:
        """Paths of the GETs of .arrow objects among requests()[since:]."""
        return [p for m, p in self.requests()[since:] if m == "GET" and p.endswith(".arrow")]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
