#!/usr/bin/env bash
# Register every site key listed in KEYS_DIR/register.txt (`fedind deploy site-keys`) with
# the SuperLink behind the flwr connection CONNECTION (see deploy/flwr-connection.sh).
#
#   deploy/register.sh CONNECTION KEYS_DIR
set -euo pipefail
connection=${1:?usage: deploy/register.sh CONNECTION KEYS_DIR}
keys=${2:?usage: deploy/register.sh CONNECTION KEYS_DIR}
while read -r site public_key fingerprint; do
  [[ -z $site || $site == \#* ]] && continue
  echo "registering $site ($fingerprint)"
  flwr supernode register "$public_key" "$connection"
done < "$keys/register.txt"
