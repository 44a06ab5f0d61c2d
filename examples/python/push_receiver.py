"""Receives a push subscription's events: an HTTP endpoint that checks every request's
Standard Webhooks signature with the `standardwebhooks` package (an implementation
independent of the gateway's) and reads the CloudEvents attributes.

Answers 204 to a request whose signature verifies and 401 to any other, so the gateway
retries what was not accepted. Prints one JSON line per verified event; stops after
--max-events events or --timeout seconds. The signing secret (whsec_...) comes from
--secret or PUSH_SECRET: the one CreateSubscription returned.

    python push_receiver.py --port 8080 --secret whsec_... --max-events 10
"""

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError


def main():
    arguments = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arguments.add_argument("--host", default="127.0.0.1")
    arguments.add_argument("--port", type=int, default=8080)
    arguments.add_argument("--secret", default=os.environ.get("PUSH_SECRET"))
    arguments.add_argument("--max-events", type=int, default=0, help="0: no limit")
    arguments.add_argument("--timeout", type=float, default=30)
    options = arguments.parse_args()
    if not options.secret:
        sys.exit("give the signing secret with --secret or PUSH_SECRET")
    webhook = Webhook(options.secret)
    received = []
    done = threading.Event()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            try:
                webhook.verify(body, dict(self.headers.items()), json_parse=False)
            except WebhookVerificationError as error:
                self.send_response(401)
                self.end_headers()
                self.wfile.write(str(error).encode())
                return
            with lock:
                for event in cloudevents(self.headers, body):
                    # A retry sends the same events again: deduplicate on their ids.
                    if event["id"] not in {e["id"] for e in received}:
                        received.append(event)
                        print(json.dumps(event), flush=True)
                if options.max_events and len(received) >= options.max_events:
                    done.set()
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((options.host, options.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    done.wait(options.timeout)
    server.shutdown()


def cloudevents(headers, body):
    """The CloudEvents attributes of the request's events: from headers (binary mode),
    or the body (structured mode: one document; batched push: an array of them)."""
    content_type = headers.get("content-type", "")
    if content_type.startswith("application/cloudevents-batch+json"):
        return [structured(document, "batch") for document in json.loads(body)]
    if content_type.startswith("application/cloudevents+json"):
        return [structured(json.loads(body), "structured")]
    return [
        {
            "id": headers["ce-id"],
            "type": headers["ce-type"],
            "source": headers["ce-source"],
            "subject": headers.get("ce-subject"),
            "transactionid": headers.get("ce-transactionid"),
            "data": json.loads(body) if "json" in content_type else None,
            "mode": "binary",
        }
    ]


def structured(document, mode):
    return {
        "id": document["id"],
        "type": document["type"],
        "source": document["source"],
        "subject": document.get("subject"),
        "transactionid": document.get("transactionid"),
        "data": document.get("data", document.get("data_base64")),
        "mode": mode,
    }


if __name__ == "__main__":
    main()
