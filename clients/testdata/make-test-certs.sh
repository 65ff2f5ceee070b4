#!/usr/bin/env bash
# Make throwaway x509 v3 certificates for the clients' TLS tests, with the
# openssl CLI, into DIR (created if missing). Both suites (Python, Node) run it
# at test set-up; nothing it writes is committed. ECDSA P-256 keys (fast to
# make), PKCS#8 PEM, valid for two days.
#
#   make-test-certs.sh DIR
#
#   ca.pem, ca.key                   the test CA (basicConstraints CA:TRUE)
#   server.pem, server.key           serverAuth, SAN IP:127.0.0.1 and DNS:localhost
#   client.pem, client.key           clientAuth, CN=orders-client, signed by the CA
#   rogue-ca.pem                     another CA, which the server does not trust
#   rogue-client.pem, rogue-client.key   clientAuth, CN=orders-client, signed by the rogue CA
set -euo pipefail
dir=${1:?usage: make-test-certs.sh DIR}
openssl=${OPENSSL:-openssl}
mkdir -p "$dir"
cd "$dir"

key() { "$openssl" genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

ca() { # name CN
  key "$1.key"
  "$openssl" req -x509 -new -key "$1.key" -out "$1.pem" -days 2 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -addext "subjectKeyIdentifier=hash"
}

leaf() { # name CN issuer extensions...
  local name=$1 cn=$2 issuer=$3
  shift 3
  key "$name.key"
  "$openssl" req -new -key "$name.key" -out "$name.csr" -subj "/CN=$cn"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature"
    echo "subjectKeyIdentifier=hash"
    echo "authorityKeyIdentifier=keyid,issuer"
    printf '%s\n' "$@"
  } >"$name.ext"
  "$openssl" x509 -req -in "$name.csr" -CA "$issuer.pem" -CAkey "$issuer.key" \
    -set_serial "0x$("$openssl" rand -hex 16)" -days 2 -extfile "$name.ext" -out "$name.pem" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}

ca ca "idempotency test CA"
leaf server localhost ca "extendedKeyUsage=serverAuth" "subjectAltName=IP:127.0.0.1,DNS:localhost"
leaf client orders-client ca "extendedKeyUsage=clientAuth"
ca rogue-ca "rogue test CA"
leaf rogue-client orders-client rogue-ca "extendedKeyUsage=clientAuth"
