"""`fedind deploy`: CA, server certificate, SuperNode keys in the formats Flower 1.42 reads;
the deploy/ scripts' argument checks. (The processes themselves: test_deployment_e2e.py.)"""

import argparse
import socket
import ssl
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from flwr.cli.supernode.register import try_load_public_key
from flwr.supercore.primitives.asymmetric import bytes_to_public_key, sign_message, verify_signature
from flwr.supernode.cli.flower_supernode import _try_setup_client_authentication

from fedind.cli import main
from fedind.cli.deploy import (
    DeployError,
    certificate_hosts,
    read_register_list,
    subject_alt_names,
    write_certificates,
    write_site_keys,
)

REPO = Path(__file__).resolve().parents[1]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def handshake(certs: Path, cafile: Path, server_hostname: str) -> None:
    """A TLS handshake against server.pem/server.key, verified with ``cafile``."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(certs / "server.pem", certs / "server.key")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True):
                pass
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client_ctx = ssl.create_default_context(cafile=str(cafile))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with client_ctx.wrap_socket(raw, server_hostname=server_hostname):
                pass
    finally:
        thread.join(timeout=5)
        listener.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deploy") / "certs"
    write_certificates(out, ["plant-server.local", "10.1.2.3"])
    return out


def test_server_certificate_names_loopback_localhost_and_the_given_hosts(certs):
    assert certificate_hosts(certs / "server.pem") == ["127.0.0.1", "localhost", "plant-server.local", "10.1.2.3"]
    cert = x509.load_pem_x509_certificate((certs / "server.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_private_keys_are_0600_and_certificates_readable(certs):
    assert mode(certs / "ca.key") == 0o600 and mode(certs / "server.key") == 0o600
    assert mode(certs / "ca.crt") == 0o644 and mode(certs / "server.pem") == 0o644


@pytest.mark.parametrize("name", ["127.0.0.1", "localhost", "plant-server.local", "10.1.2.3"])
def test_tls_verifies_for_every_listed_name(certs, name):
    handshake(certs, certs / "ca.crt", name)


def test_tls_fails_for_an_unlisted_name_or_another_ca(certs, tmp_path):
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(certs, certs / "ca.crt", "elsewhere.example")
    write_certificates(tmp_path / "other")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(certs, tmp_path / "other" / "ca.crt", "localhost")


def test_existing_key_material_is_never_overwritten_but_the_ca_can_issue_a_new_server_cert(tmp_path):
    out = tmp_path / "certs"
    write_certificates(out)
    ca_before = (out / "ca.crt").read_bytes()
    with pytest.raises(DeployError, match="refusing to overwrite"):
        write_certificates(out, ["new-host"])
    (out / "server.pem").unlink()
    (out / "server.key").unlink()
    write_certificates(out, ["new-host"])
    assert (out / "ca.crt").read_bytes() == ca_before
    assert "new-host" in certificate_hosts(out / "server.pem")
    handshake(out, out / "ca.crt", "new-host")


def test_invalid_host_names_are_refused():
    with pytest.raises(DeployError):
        subject_alt_names(["bad host"])
    with pytest.raises(DeployError):
        subject_alt_names(["https://x"])
    assert len(subject_alt_names(["localhost", "LOCALHOST", "127.0.0.1"])) == 2


def test_site_keys_load_with_flowers_own_readers_and_sign(tmp_path):
    keys = write_site_keys(tmp_path, ["line-00", "line-01"])
    for key in keys:
        assert mode(key.private_key) == 0o600
        private = load_ssh_private_key(key.private_key.read_bytes(), None)
        assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
        # what `flwr supernode register` and `flower-supernode --auth-supernode-private-key` do
        registered = bytes_to_public_key(try_load_public_key(key.public_key))
        args = argparse.Namespace(auth_supernode_private_key=str(key.private_key), auth_supernode_public_key=None)
        node_private, _ = _try_setup_client_authentication(args)
        signature = sign_message(node_private, b"2026-11-29T20:00:00")
        assert verify_signature(registered, b"2026-11-29T20:00:00", signature)
    rows = read_register_list(tmp_path / "register.txt")
    assert [(r[0], r[1]) for r in rows] == [(k.site_id, k.public_key) for k in keys]
    assert [r[2] for r in rows] == [k.fingerprint for k in keys] and rows[0][2].startswith("SHA256:")


def test_site_keys_refuse_duplicates_bad_ids_and_overwrites(tmp_path):
    with pytest.raises(DeployError, match="duplicate"):
        write_site_keys(tmp_path, ["a", "a"])
    for bad in ("", "../x", "a b", ".hidden"):
        with pytest.raises(DeployError, match="invalid site id"):
            write_site_keys(tmp_path, [bad])
    write_site_keys(tmp_path, ["a"])
    with pytest.raises(DeployError, match="refusing to overwrite"):
        write_site_keys(tmp_path, ["a"])
    write_site_keys(tmp_path, ["b"])  # adding a site later appends to the register list
    assert [r[0] for r in read_register_list(tmp_path / "register.txt")] == ["a", "b"]


def test_cli_writes_certs_and_keys_for_the_sites_of_a_data_folder(tmp_path, capsys):
    data = tmp_path / "plant"
    assert main(["data", "generate", "--out", str(data), "--sites", "2", "--samples-per-site", "20", "--window", "64"]) == 0
    assert main(["deploy", "certs", "--out", str(tmp_path / "certs"), "--host", "plant.local"]) == 0
    assert "127.0.0.1, localhost, plant.local" in capsys.readouterr().out
    assert main(["deploy", "site-keys", "--out", str(tmp_path / "keys"), "--data-root", str(data)]) == 0
    printed = capsys.readouterr().out
    assert "flwr supernode register" in printed
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == [
        "line-00", "line-00.pub", "line-01", "line-01.pub", "register.txt"
    ]
    assert main(["deploy", "site-keys", "--out", str(tmp_path / "keys"), "line-00"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("script", sorted((REPO / "deploy").glob("*.sh")), ids=lambda p: p.name)
def test_deploy_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert script.stat().st_mode & stat.S_IXUSR


def test_supernode_script_refuses_relative_paths_and_superlink_script_missing_certs(tmp_path):
    done = subprocess.run(
        [REPO / "deploy" / "supernode.sh", "--superlink", "127.0.0.1:1", "--ca", "ca.crt", "--key", "k",
         "--data-dir", "relative/data", "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True,
    )
    assert done.returncode == 2 and "absolute path" in done.stderr
    done = subprocess.run([REPO / "deploy" / "superlink.sh", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and "ca.crt missing" in done.stderr


def test_systemd_units_run_the_deploy_scripts():
    units = sorted((REPO / "deploy" / "systemd").glob("*.service"))
    assert {u.name for u in units} >= {"fedind-superlink.service", "fedind-supernode@.service"}
    for unit in units:
        text = unit.read_text()
        exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
        script = exec_start.split("=", 1)[1].split()[0]
        assert (REPO / "deploy" / Path(script).name).exists(), script
        assert "Restart=" in text and "User=fedind" in text
