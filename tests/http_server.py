"""A real HTTP server for tests: serves a directory on 127.0.0.1, optionally failing on purpose.

    python tests/http_server.py ROOT PORT_FILE [--fail N:REGEX ...]

Binds a free port and writes it to PORT_FILE (atomically) once it accepts connections. With
``--fail N:REGEX`` the first N requests of every path that matches REGEX are answered with
HTTP 500 (then the file is served). Logs one line per request to stderr.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer


class Handler(SimpleHTTPRequestHandler):
    failures: list = []
    seen: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def do_GET(self):  # noqa: N802 - http.server's naming
        for n, pattern in self.failures:
            if pattern.search(self.path):
                with self.lock:
                    self.seen[self.path] += 1
                    count = self.seen[self.path]
                if count <= n:
                    self.send_error(500, f"failing on purpose ({count} of {n})")
                    return
        super().do_GET()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("port_file")
    ap.add_argument("--fail", action="append", default=[], metavar="N:REGEX")
    args = ap.parse_args()
    Handler.failures = [(int(f.split(":", 1)[0]), re.compile(f.split(":", 1)[1])) for f in args.fail]
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=args.root))
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, args.port_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
