"""A throwaway certificate for TLS tests."""

from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate and key for 127.0.0.1, made with the openssl CLI."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key
