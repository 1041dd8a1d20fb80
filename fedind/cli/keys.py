"""``fedind keys paillier``: the key pair of an encrypted federation (``encryption = "paillier"``).

::

    fedind keys paillier --out DIR [--bits 2048] [--passphrase-env VAR]

writes ``DIR/paillier.key`` (private: p, q and the obfuscator subgroup orders; mode 0600; for every SITE) and
``DIR/paillier.pub`` (public: n; for the SERVER) and prints the key fingerprint that every
encrypted payload carries. Neither file is overwritten: rotating keys means a new folder
(README: "Encrypted aggregation", provisioning and rotation).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..paillier.keys import PASSPHRASE_ENV, generate_keypair, save_keypair
from ..paillier.packing import FINE

PRIVATE_FILE = "paillier.key"
PUBLIC_FILE = "paillier.pub"


def add_commands(commands) -> None:
    """Add ``keys paillier`` to the ``fedind`` subcommands (argparse subparsers)."""
    keys = commands.add_parser("keys", help="create the key pair of an encrypted federation")
    keys.set_defaults(help_parser=keys)
    sub = keys.add_subparsers(title="commands", metavar="COMMAND")
    paillier = sub.add_parser(
        "paillier",
        help="Paillier key pair: private key for the sites, public key for the server",
        description="Write DIR/paillier.key (private, mode 0600: copy to every site) and "
        "DIR/paillier.pub (public: the server's run config paillier-public-key).",
    )
    paillier.add_argument("--out", required=True, type=Path, metavar="DIR", help="folder to write (created if missing)")
    paillier.add_argument("--bits", type=int, default=2048, metavar="B", help="modulus size in bits (default %(default)s)")
    paillier.add_argument(
        "--passphrase-env", metavar="VAR", default=None,
        help="seal the private key with the passphrase in environment variable VAR (scrypt + AES-GCM); "
        f"sites then need it in {PASSPHRASE_ENV}",
    )
    paillier.set_defaults(run=_paillier)


def _paillier(args: argparse.Namespace) -> int:
    passphrase = None
    if args.passphrase_env:
        passphrase = os.environ.get(args.passphrase_env)
        if not passphrase:
            raise ValueError(f"--passphrase-env {args.passphrase_env}: that environment variable is empty or unset")
    out = args.out.expanduser().resolve()
    private, public = out / PRIVATE_FILE, out / PUBLIC_FILE
    for path in (private, public):
        if path.exists():
            raise ValueError(f"{path} already exists; keys are never overwritten (rotate into a new folder)")
    key = generate_keypair(args.bits)
    out.mkdir(parents=True, exist_ok=True)
    save_keypair(key, private, public, passphrase)
    print(f"Paillier key pair, {key.public.bits} bits, fingerprint {key.public.fingerprint}")
    print(f"  {private}  private (mode 0600{', sealed' if passphrase else ''}): copy to every SITE only")
    print(f"  {public}  public: the SERVER's key")
    print(f"  {FINE.slots(key.public)} values per {key.public.ciphertext_bytes}-byte ciphertext at the default "
          f"layout; up to {FINE.max_weight} sites per sum")
    print()
    print("server run config:  paillier-public-key='<path>/paillier.pub'  encryption='paillier'")
    print("each site:          flower-supernode ... --node-config \"paillier-private-key='<path>/paillier.key'\"")
    return 0
