#!/usr/bin/env bash
# Start one site agent (a SuperNode) for one production line.
#
#   deploy/supernode.sh --superlink HOST:PORT --ca CA_CERT --key SITE_KEY \
#                       --data-dir DIR --state-dir DIR [--serve-dir DIR] [--site-id ID] [--port N]
#                       [--site-worker on|off] [--paillier-key FILE]
#
# --ca        the plant CA certificate (ca.crt) that signed the SuperLink's certificate
# --key       this site's private key (`fedind deploy site-keys`), registered with the SuperLink
# --data-dir  the site's folder: train.npz (+ test.npz) in fedind's site data format
# --state-dir where the site keeps its state across restarts (fedind.site.state), per run
# --serve-dir publish every global model received there, for `fedind serve --watch DIR` at the line
# --site-id   defaults to the data folder's name
# --port      local port of this SuperNode's own Runtime API (default 9094; one per agent)
# --site-worker  on (default): each message's process hands the message to a long-lived worker
#             of this site (fedind.site.worker, socket in STATE_DIR/worker); off: every message
#             is handled in its own process (node config site-worker=false)
# --paillier-key  the federation's Paillier private key (`fedind keys paillier`; mode 0600) for runs
#             with encryption = 'paillier' (node config paillier-private-key); the server never has it
# FLWR_HOME (default ~/.flwr) is where the SuperNode installs the apps it is sent.
set -euo pipefail
usage() { sed -n '4,6p' "$0" >&2; exit 2; }
superlink= ca= key= data_dir= state_dir= serve_dir= site_id= port=9094 site_worker=on paillier_key=
while (($#)); do
  case $1 in
    --superlink) superlink=$2 ;; --ca) ca=$2 ;; --key) key=$2 ;;
    --data-dir) data_dir=$2 ;; --state-dir) state_dir=$2 ;; --serve-dir) serve_dir=$2 ;;
    --site-id) site_id=$2 ;;
    --port) port=$2 ;; --site-worker) site_worker=$2 ;; --paillier-key) paillier_key=$2 ;; *) usage ;;
  esac
  shift 2 || usage
done
[[ -n $superlink && -n $ca && -n $key && -n $data_dir && -n $state_dir ]] || usage
[[ $site_worker == on || $site_worker == off ]] || { echo "supernode.sh: --site-worker must be on or off" >&2; exit 2; }
for path in "$data_dir" "$state_dir" ${serve_dir:+"$serve_dir"} ${paillier_key:+"$paillier_key"}; do
  [[ $path == /* && $path != *"'"* ]] || { echo "supernode.sh: $path must be an absolute path without quotes" >&2; exit 2; }
done
mkdir -p "$state_dir" && chmod 700 "$state_dir"
node_config="data-dir='$data_dir' state-dir='$state_dir'"
[[ -n $serve_dir ]] && node_config+=" serve-dir='$serve_dir'"
[[ -n $site_id ]] && node_config+=" site-id='$site_id'"
[[ $site_worker == off ]] && node_config+=" site-worker=false"
[[ -n $paillier_key ]] && node_config+=" paillier-private-key='$paillier_key'"
exec flower-supernode \
  --superlink "$superlink" \
  --root-certificates "$ca" \
  --auth-supernode-private-key "$key" \
  --port "$port" \
  --node-config "$node_config"
