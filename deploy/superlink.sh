#!/usr/bin/env bash
# Start the plant's SuperLink: TLS on, SuperNode authentication on (only SuperNodes whose
# public key was registered with `flwr supernode register` may connect).
#
#   deploy/superlink.sh CERTS_DIR [PORT] [DATABASE]
#
# CERTS_DIR holds ca.crt, server.pem, server.key (`fedind deploy certs --out CERTS_DIR`).
# PORT (default 8000, Flower's) serves Flower 1.42's Fleet, Control and Runtime APIs over HTTPS.
# DATABASE: a SQLite file that keeps registered SuperNodes and runs across restarts
# (default: in memory, registrations are lost when the SuperLink stops).
# Apps run in this Python environment: runtime dependency installation is disabled.
set -euo pipefail
certs=${1:?usage: deploy/superlink.sh CERTS_DIR [PORT] [DATABASE]}
port=${2:-8000}
database=${3:-}
for f in ca.crt server.pem server.key; do
  [[ -r "$certs/$f" ]] || { echo "superlink.sh: $certs/$f missing (fedind deploy certs --out $certs)" >&2; exit 2; }
done
exec flower-superlink \
  --ssl-ca-certfile "$certs/ca.crt" --ssl-certfile "$certs/server.pem" --ssl-keyfile "$certs/server.key" \
  --enable-supernode-auth \
  --disable-runtime-dependency-installation \
  --port "$port" \
  ${database:+--database "$database"}
