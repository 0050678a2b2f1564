"""TLS for the endpoints hpcml listens on: the server's `ssl.SSLContext` from a `TlsConfig`.

One place checks the PEM files (they exist, they load, the key matches the certificate), so
`hpcml serve --tls-cert ...` and `observe.tls` of training ranks refuse a wrong file in one
sentence before anything listens. The context asks for TLS 1.2 or later and, with a client CA,
a client certificate that chains to it (mutual TLS).
"""

from __future__ import annotations

import ssl
from pathlib import Path

from hpcml.config_sections import TlsConfig
from hpcml.errors import ConfigError


def read_pem(path: str, where: str) -> bytes:
    """The bytes of a PEM file; ConfigError naming `where` (an option or key) if unreadable."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{where} {path!r} is not a file; pass the path of a PEM file.")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where} {path!r} cannot be read ({exc.strerror}).") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{where} {path!r} holds no PEM block; pass a PEM file.")
    return data


def server_context(tls: TlsConfig, where: str = "tls") -> ssl.SSLContext:
    """A server-side context presenting `tls.cert`, requiring client certificates signed by
    `tls.client_ca` when it is set. `where` names the settings in error sentences."""
    for path, key in ((tls.cert, "cert"), (tls.key, "key"), (tls.client_ca, "client_ca")):
        if path is not None:
            read_pem(path, f"{where} {key}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{where}: the certificate {tls.cert!r} and key {tls.key!r} cannot be used together "
            f"({exc.reason or exc}); pass a PEM certificate and its unencrypted private key."
        ) from None
    if tls.client_ca is not None:
        try:
            context.load_verify_locations(cafile=tls.client_ca)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{where}: the client CA {tls.client_ca!r} cannot be loaded "
                f"({exc.reason or exc}); pass a PEM bundle of CA certificates."
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context
