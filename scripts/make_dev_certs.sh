#!/usr/bin/env bash
# Throwaway certificates for trying TLS on one machine (not for production):
#   bash scripts/make_dev_certs.sh DIR
# writes into DIR (created if missing):
#   ca.pem, ca.key          a self-signed CA (valid 30 days)
#   server.pem, server.key  signed by it, subjectAltName IP:127.0.0.1, DNS:localhost
#                           (what clients dial; serverAuth): the services' --tls-cert / --tls-key
#   client.pem, client.key  signed by it (clientAuth): the orchestrator's --worker-tls-cert /
#                           --worker-tls-key for mutual TLS (workers started with --tls-client-ca ca.pem)
# Needs openssl (1.1.1 or later). Keys are P-256 ECDSA, readable by the owner only.
set -euo pipefail
dir=${1:?usage: bash scripts/make_dev_certs.sh DIR}
mkdir -p "$dir"
cd "$dir"
umask 077
days=30

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem \
  -days "$days" -subj "/CN=specdec dev CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

issue() {  # issue NAME CN EXTENSIONS
  local name=$1 cn=$2 ext=$3
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$name.key" -out "$name.csr" \
    -subj "/CN=$cn" 2>/dev/null
  printf '%s\n' "$ext" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days "$days" \
    -extfile "$name.ext" -out "$name.pem" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}
issue server localhost "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost"
issue client specdec-orchestrator "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
rm -f ca.srl
chmod 644 ca.pem server.pem client.pem
echo "wrote $(pwd)/{ca,server,client}.{pem,key}"
