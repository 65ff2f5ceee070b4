"""Sign a body as the provider would, for trying the receiver by hand:

    python sign.py --secret whsec_test event.json    # prints the header value
    curl -H "Webhook-Signature: $(python sign.py --secret whsec_test event.json)" \
         -H 'Content-Type: application/json' --data-binary @event.json \
         http://127.0.0.1:8000/webhooks

The signature covers the file's bytes exactly (send them with
--data-binary, which does not touch newlines) and the current time.
"""

import argparse
import hashlib
import hmac
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--secret", required=True, help="the shared signing secret (WEBHOOK_SECRET)")
    parser.add_argument("--timestamp", type=int, help="unix time to sign with (default: now)")
    parser.add_argument("body", help="file holding the raw body, or - for standard input")
    args = parser.parse_args()
    body = sys.stdin.buffer.read() if args.body == "-" else open(args.body, "rb").read()
    timestamp = args.timestamp if args.timestamp is not None else int(time.time())
    mac = hmac.new(args.secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    print(f"t={timestamp},v1={mac}")


if __name__ == "__main__":
    main()
