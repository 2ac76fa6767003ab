"""Container health probe: GET the coordinator's /health; exit 0 when it answers "ok".

ZOO_GYM_HEALTH_URL  default http://127.0.0.1:8080/health (https://... when REST serves TLS)
ZOO_GYM_CA_CERT     CA certificate the https answer must chain to (the coordinator's tls/ca.pem);
                    the host name is not checked, since the probe dials 127.0.0.1

/health answers 503 with a `reason` once the round loop has stopped or crashed, and while the
coordinator stops; the probe prints that reason.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.error
import urllib.request

url = os.environ.get("ZOO_GYM_HEALTH_URL", "http://127.0.0.1:8080/health")
context = None
if url.startswith("https://"):
    context = ssl.create_default_context(cafile=os.environ.get("ZOO_GYM_CA_CERT") or None)
    context.check_hostname = False
try:
    with urllib.request.urlopen(url, timeout=5, context=context) as response:
        body = json.load(response)
except urllib.error.HTTPError as exc:
    try:
        reason = json.load(exc).get("reason") or exc.reason
    except (ValueError, AttributeError):
        reason = exc.reason
    print(f"unhealthy: {url}: {exc.code}: {reason}", file=sys.stderr)
    sys.exit(1)
except Exception as exc:
    print(f"unhealthy: {url}: {exc}", file=sys.stderr)
    sys.exit(1)
if body.get("status") != "ok":
    print(f"unhealthy: {url}: {body.get('reason') or body.get('status')}", file=sys.stderr)
    sys.exit(1)
sys.exit(0)
