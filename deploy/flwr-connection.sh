#!/usr/bin/env bash
# Add a SuperLink connection to the flwr CLI's config (${FLWR_HOME:-~/.flwr}/config.toml),
# verified against the plant CA, so that `flwr run . NAME` and `flwr supernode ... NAME` work.
#
#   deploy/flwr-connection.sh NAME HOST:PORT CA_CERT
set -euo pipefail
name=${1:?usage: deploy/flwr-connection.sh NAME HOST:PORT CA_CERT}
address=${2:?usage: deploy/flwr-connection.sh NAME HOST:PORT CA_CERT}
ca=$(realpath "${3:?usage: deploy/flwr-connection.sh NAME HOST:PORT CA_CERT}")
config="${FLWR_HOME:-$HOME/.flwr}/config.toml"
flwr config list > /dev/null  # creates the default config file if there is none
if grep -q "^\[superlink\.$name\]" "$config"; then
  echo "flwr-connection.sh: $config already has [superlink.$name]; edit it there" >&2
  exit 2
fi
printf '\n[superlink.%s]\naddress = "%s"\nroot-certificates = "%s"\n' "$name" "$address" "$ca" >> "$config"
echo "added [superlink.$name] ($address, CA $ca) to $config"
