#!/usr/bin/env bash
# Makes a private CA and a serving certificate for the injection webhook, stores them as Secret
# harnessrl-webhook-tls and puts the CA into the MutatingWebhookConfiguration's caBundle.
# Run once after `kubectl apply -k k8s/<overlay>` (and again before the certificate expires).
# With cert-manager installed you can replace this by a Certificate plus the
# cert-manager.io/inject-ca-from annotation.
set -euo pipefail
NS="${NS:-harnessrl}"
SVC="${SVC:-harnessrl-webhook}"
DAYS="${DAYS:-825}"
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT

openssl req -x509 -newkey rsa:2048 -nodes -days "$DAYS" -subj "/CN=harnessrl-webhook-ca" \
  -keyout "$DIR/ca.key" -out "$DIR/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=$SVC.$NS.svc" \
  -keyout "$DIR/tls.key" -out "$DIR/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s,DNS:%s.%s,DNS:%s.%s.svc,DNS:%s.%s.svc.cluster.local\n' \
  "$SVC" "$SVC" "$NS" "$SVC" "$NS" "$SVC" "$NS" > "$DIR/ext.cnf"
openssl x509 -req -in "$DIR/tls.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" -CAcreateserial \
  -days "$DAYS" -extfile "$DIR/ext.cnf" -out "$DIR/tls.crt" 2>/dev/null

kubectl -n "$NS" create secret tls harnessrl-webhook-tls \
  --cert="$DIR/tls.crt" --key="$DIR/tls.key" --dry-run=client -o yaml | kubectl apply -f -
CA_BUNDLE="$(base64 < "$DIR/ca.crt" | tr -d '\n')"
kubectl patch mutatingwebhookconfiguration harnessrl-sidecar-injector --type=json \
  -p "[{\"op\": \"add\", \"path\": \"/webhooks/0/clientConfig/caBundle\", \"value\": \"$CA_BUNDLE\"}]"
kubectl -n "$NS" rollout restart deployment/harnessrl-webhook
echo "webhook TLS installed (CA valid for $DAYS days)"
