"""What a deployment needs, generated with the ``cryptography`` package.

Flower 1.42 (checked against its source: ``flwr/superlink/cli/flower_superlink.py``,
``flwr/supernode/cli/flower_supernode.py``, ``flwr/cli/supernode/register.py``):

* **TLS.** ``flower-superlink --ssl-ca-certfile ca.crt --ssl-certfile server.pem
  --ssl-keyfile server.key`` serves the Fleet, Control and Runtime APIs on one HTTPS port
  (8000 by default). The SuperLink's own SuperExec connects to that port on 127.0.0.1 and
  verifies it against ``ca.crt``, so the server certificate must name 127.0.0.1 (and
  ``localhost``) besides the host names the plant's SuperNodes dial.
  ``flower-supernode --root-certificates ca.crt`` and ``flwr`` (``root-certificates`` in
  ``$FLWR_HOME/config.toml``) verify the server against the CA.
* **SuperNode authentication.** ``flower-superlink --enable-supernode-auth`` (requires TLS)
  refuses every SuperNode whose public key was not registered with
  ``flwr supernode register <key>.pub <connection>``. A SuperNode proves its key by signing
  a timestamp on every request: ``flower-supernode --auth-supernode-private-key <key>``.
  Keys are ECDSA on a NIST curve in OpenSSH format (Flower generates P-384 itself), the
  private key as an unencrypted OpenSSH private key file, the public key as one
  ``ecdsa-sha2-nistp384 ...`` line.

Written by :func:`write_certificates` (``fedind deploy certs --out CERTS``) and
:func:`write_site_keys` (``fedind deploy site-keys --out KEYS``)::

    CERTS/ca.crt  ca.key (0600)  server.pem  server.key (0600)
    KEYS/<site-id> (private key, 0600)  KEYS/<site-id>.pub
    KEYS/register.txt   one "<site-id> <public key file> <SHA256 fingerprint>" per line
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY = "ca.crt", "ca.key", "server.pem", "server.key"
REGISTER_LIST = "register.txt"
SITE_KEY_CURVE = ec.SECP384R1  # what Flower generates for its own SuperNode keys


class DeployError(ValueError):
    """Arguments that cannot produce a working deployment (message says why)."""


@dataclass(frozen=True)
class SiteKey:
    site_id: str
    private_key: Path
    public_key: Path
    fingerprint: str  # SHA256:<base64>, as ``ssh-keygen -lf`` prints it


# --------------------------------------------------------------------------- files


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start (no window with wider permissions);
    an existing file is never overwritten."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(path, mode)  # the umask may have narrowed it further; make it exact


def _refuse_existing(paths: Iterable[Path]) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        raise DeployError(
            f"{', '.join(existing)} already exist; refusing to overwrite key material "
            "(move it away or choose another --out)"
        )


# --------------------------------------------------------------------------- TLS


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedind"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def subject_alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """127.0.0.1 and localhost, then each extra host as an IP or a DNS name (deduplicated)."""
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for host in (*DEFAULT_HOSTS, *hosts):
        host = host.strip().strip("[]")
        if not host or host.lower() in seen:
            continue
        seen.add(host.lower())
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if any(c in host for c in " /:@") or host.startswith(".") or host.endswith("."):
                raise DeployError(f"{host!r} is neither an IP address nor a host name") from None
            names.append(x509.DNSName(host))
    return names


def make_ca(days: int, common_name: str = "fedind deployment CA") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, hosts: Sequence[str], days: int
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    sans = subject_alt_names(hosts)
    cn = next((str(n.value) for n in sans if isinstance(n, x509.DNSName) and n.value != "localhost"), "localhost")
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_certificates(out: Path, hosts: Sequence[str] = (), days: int = 825) -> dict[str, Path]:
    """A new CA and a server certificate signed by it for 127.0.0.1, localhost and
    ``hosts``. With an existing ``ca.crt`` + ``ca.key`` in ``out`` only the server pair is
    (re)issued from that CA — e.g. to add a host name — so the sites' ``ca.crt`` stays valid."""
    if days < 1:
        raise DeployError(f"--days must be >= 1, got {days}")
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in (CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY)}
    _refuse_existing([paths[SERVER_CERT], paths[SERVER_KEY]])
    if paths[CA_CERT].exists() and paths[CA_KEY].exists():
        ca_cert = x509.load_pem_x509_certificate(paths[CA_CERT].read_bytes())
        ca_key = serialization.load_pem_private_key(paths[CA_KEY].read_bytes(), password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise DeployError(f"{paths[CA_KEY]}: not an EC private key")
    else:
        _refuse_existing([paths[CA_CERT], paths[CA_KEY]])
        ca_key, ca_cert = make_ca(days)
        _write_new(paths[CA_KEY], _pem_key(ca_key), 0o600)
        _write_new(paths[CA_CERT], _pem_cert(ca_cert), 0o644)
    key, cert = make_server_cert(ca_key, ca_cert, hosts, days)
    _write_new(paths[SERVER_KEY], _pem_key(key), 0o600)
    _write_new(paths[SERVER_CERT], _pem_cert(cert), 0o644)
    return paths


def certificate_hosts(path: Path) -> list[str]:
    """The SAN entries of a certificate file, as strings."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in san]


# --------------------------------------------------------------------------- site keys


def _check_site_id(site_id: str) -> str:
    if not site_id or site_id.startswith(".") or any(c in site_id for c in "/\\ \t\n") or site_id.endswith(".pub"):
        raise DeployError(f"invalid site id {site_id!r}: use letters, digits, '-', '_' or '.'")
    return site_id


def ssh_fingerprint(public_line: bytes) -> str:
    blob = base64.b64decode(public_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def write_site_keys(out: Path, site_ids: Sequence[str]) -> list[SiteKey]:
    """One ECDSA P-384 key pair per site in OpenSSH format (private key 0600), and
    ``register.txt`` listing every key in ``out`` (appended to across calls)."""
    ids = [_check_site_id(s) for s in site_ids]
    if len(set(ids)) != len(ids):
        raise DeployError(f"duplicate site ids in {ids}")
    if not ids:
        raise DeployError("give at least one site id")
    out.mkdir(parents=True, exist_ok=True)
    _refuse_existing([p for s in ids for p in (out / s, out / f"{s}.pub")])
    keys = []
    for site in ids:
        key = ec.generate_private_key(SITE_KEY_CURVE())
        private = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        public += f" fedind-site-{site}\n".encode()
        _write_new(out / site, private, 0o600)
        _write_new(out / f"{site}.pub", public, 0o644)
        keys.append(SiteKey(site, out / site, out / f"{site}.pub", ssh_fingerprint(public)))
    with open(out / REGISTER_LIST, "a", encoding="utf-8") as f:
        for k in keys:
            f.write(f"{k.site_id} {k.public_key.resolve()} {k.fingerprint}\n")
        f.flush()
        os.fsync(f.fileno())
    return keys


def read_register_list(path: Path) -> list[tuple[str, Path, str]]:
    """(site id, public key file, fingerprint) per line of ``register.txt``."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3:
            raise DeployError(f"{path}:{number}: expected '<site-id> <public key file> <fingerprint>'")
        rows.append((parts[0], Path(parts[1]), parts[2]))
    return rows


# --------------------------------------------------------------------------- command line


def add_commands(commands) -> None:  # commands: argparse "_SubParsersAction" of `fedind`
    """``fedind deploy certs`` and ``fedind deploy site-keys`` (wired in fedind/cli/__init__.py)."""
    deploy = commands.add_parser("deploy", help="generate TLS certificates and SuperNode keys")
    deploy.set_defaults(help_parser=deploy)
    sub = deploy.add_subparsers(title="commands", metavar="COMMAND")

    certs = sub.add_parser(
        "certs",
        help="a CA and the SuperLink's TLS certificate",
        description="Write OUT/ca.crt, ca.key (0600), server.pem, server.key (0600). The server "
        "certificate names 127.0.0.1, localhost and every --host. With an existing ca.crt + ca.key "
        "in OUT only the server pair is issued (from that CA).",
    )
    certs.add_argument("--out", required=True, type=Path, metavar="DIR")
    certs.add_argument(
        "--host", action="append", default=[], metavar="NAME_OR_IP",
        help="extra host name or IP the SuperNodes use to reach the SuperLink (repeatable)",
    )
    certs.add_argument("--days", type=int, default=825, help="validity in days (default %(default)s)")
    certs.set_defaults(run=_run_certs)

    keys = sub.add_parser(
        "site-keys",
        help="one SuperNode authentication key pair per site, and the list to register",
        description="Write OUT/<site-id> (OpenSSH ECDSA P-384 private key, 0600), OUT/<site-id>.pub and "
        "append to OUT/register.txt. Register each .pub with `flwr supernode register`.",
    )
    keys.add_argument("--out", required=True, type=Path, metavar="DIR")
    keys.add_argument("site_ids", nargs="*", metavar="SITE_ID", help="e.g. line-00 line-01")
    keys.add_argument(
        "--data-root", type=Path, metavar="DIR",
        help="take the site ids from DIR/sites/ (a site data folder) instead",
    )
    keys.set_defaults(run=_run_site_keys)


def _run_certs(args) -> int:
    out = args.out.expanduser().resolve()
    paths = write_certificates(out, args.host, args.days)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    print(f"server certificate names: {', '.join(certificate_hosts(paths[SERVER_CERT]))}")
    print("start the SuperLink with:")
    print(
        f"  flower-superlink --ssl-ca-certfile {paths[CA_CERT]} --ssl-certfile {paths[SERVER_CERT]} "
        f"--ssl-keyfile {paths[SERVER_KEY]} --enable-supernode-auth"
    )
    print(f"give every site {paths[CA_CERT]} (never ca.key or server.key)")
    return 0


def _run_site_keys(args) -> int:
    from ..data.format import list_sites  # noqa: PLC0415 (keeps `fedind deploy` light)

    ids = list(args.site_ids)
    if args.data_root is not None:
        ids += list_sites(args.data_root.expanduser().resolve())
    out = args.out.expanduser().resolve()
    keys = write_site_keys(out, ids)
    for k in keys:
        print(f"{k.site_id:<12} {k.private_key} (0600)  {k.public_key}  {k.fingerprint}")
    print(f"listed in {out / REGISTER_LIST}; register them with the SuperLink:")
    for k in keys:
        print(f"  flwr supernode register {k.public_key} <connection>")
    return 0
