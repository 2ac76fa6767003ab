"""Container health probe: GET the coordinator's /health; exit 0 when it answers "ok".

ZOO_GYM_HEALTH_URL  default http://127.0.0.1:8080/health (https://... when REST serves TLS)
ZOO_GYM_CA_CERT     CA certificate the https answer must chain to (the coordinator's tls/ca.pem);
                    the host name is not checked, since the probe dials 127.0.0.1
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.request

url = os.environ.get("ZOO_GYM_HEALTH_URL", "http://127.0.0.1:8080/health")
context = None
if url.startswith("https://"):
    context = ssl.create_default_context(cafile=os.environ.get("ZOO_GYM_CA_CERT") or None)
    context.check_hostname = False
try:
    with urllib.request.urlopen(url, timeout=5, context=context) as response:
        ok = json.load(response).get("status") == "ok"
except Exception as exc:
    print(f"unhealthy: {url}: {exc}", file=sys.stderr)
    sys.exit(1)
sys.exit(0 if ok else 1)
