"""A throwaway CA and a certificate for 127.0.0.1 that it signs, for the servers' TLS ports (openssl)."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["make_certificates"]


def make_certificates(directory: Path) -> None:
    """ca.pem (a throwaway CA) and server.pem / server.key (127.0.0.1, signed by it) in `directory`.

    EC keys: made in a few milliseconds. Needs the `openssl` command.
    """
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (directory / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n"
    )
    for args in (
        [
            "req",
            "-x509",
            *ec,
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=kvtier test CA",
        ],
        ["req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        [
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    ):
        subprocess.run(
            ["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30
        )
