"""A cluster CA and node certificates for mutual TLS, made with the `openssl` command line tool.

    pdserve certs --out DIR [--host 10.0.0.5 --host decode-0.pdserve ...]

writes DIR/ca.pem (the cluster CA: every service's --tls-ca), DIR/node.pem and DIR/node.key (one
certificate for every service, valid for server and client use, with the hosts as subject
alternative names; `pdserve` — the name peers verify, since pod addresses change — 127.0.0.1 and
localhost are always included). The CA key stays in DIR/ca.key
to sign more node certificates; keep it off the nodes. `pdserve up --tls` makes a fresh set per start.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Under TLS, peers (gRPC and KV) are verified by the cluster CA and this name, which every node
# certificate carries (`pdserve certs` adds it): pod addresses change, so certificates cannot list them.
TLS_SERVER_NAME = "pdserve"


@dataclass(frozen=True)
class CertFiles:
    ca: Path
    cert: Path
    key: Path

    def flags(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command line tool is needed to make certificates (apt-get install openssl)")
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _new_key_request(key: Path, subject: str, csr: Path | None = None, x509_days: int | None = None,
                     out: Path | None = None) -> None:
    args = ["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
            "-subj", subject]
    if x509_days is not None:
        args += ["-x509", "-days", str(x509_days), "-out", str(out),
                 "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"]
    else:
        args += ["-out", str(csr)]
    _openssl(*args)


def make_cluster_certs(out_dir: str | Path, hosts: list[str] | tuple[str, ...] = (), days: int = 30,
                       name: str = "pdserve") -> CertFiles:
    """A new CA and one node certificate signed by it, for `hosts` (+ loopback)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ca, ca_key = out / "ca.pem", out / "ca.key"
    cert, key, csr, ext = out / "node.pem", out / "node.key", out / "node.csr", out / "node.ext"
    _new_key_request(ca_key, f"/CN={name}-cluster-ca", x509_days=days, out=ca)
    _new_key_request(key, f"/CN={name}-node", csr=csr)
    names = []
    for host in dict.fromkeys([TLS_SERVER_NAME, "127.0.0.1", "localhost", *hosts]):
        try:
            ipaddress.ip_address(host)
            names.append(f"IP:{host}")
        except ValueError:
            names.append(f"DNS:{host}")
    ext.write_text(f"subjectAltName={','.join(names)}\nbasicConstraints=CA:FALSE\n"
                   "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-out", str(cert), "-days", str(days), "-extfile", str(ext))
    csr.unlink()
    ext.unlink()
    for secret in (key, ca_key):
        secret.chmod(0o600)
    return CertFiles(ca, cert, key)
