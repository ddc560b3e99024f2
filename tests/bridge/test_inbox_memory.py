"""The inbox's memory is bounded in bytes: large messages against a slow API.

200 messages of 900 KB (180 MB) wait for an API that never answers in time.
Bounded by count alone (1,000 per partition) the relay would hold all of them;
bounded by ``POIMEN_INBOX_BUFFER_BYTES`` it pauses fetching at the budget.
"""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from confluent_kafka import Producer

from tests.bridge import test_inbox_relay
from tests.bridge.test_inbox_relay import metric, request
from tests.processes import wait_until

web = test_inbox_relay.web
setup = test_inbox_relay.setup

pytestmark = pytest.mark.slow

BUDGET = 16 * 1024 * 1024
MESSAGES = 200
SIZE = 900 * 1024


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Stalled(BaseHTTPRequestHandler):
    """An API that holds every call for a long time (a slow or overloaded API)."""

    def do_POST(self):  # noqa: N802
        time.sleep(60)
        self.send_response(503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_slow_api_and_large_messages_keep_the_relay_within_its_byte_budget(setup):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stalled)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        setup.declare(partitions=4)
        relay, metrics_url = setup.start_relay(
            POIMEN_API_URL=f"http://127.0.0.1:{server.server_port}",
            POIMEN_INBOX_BUFFER_BYTES=str(BUDGET), POIMEN_INBOX_HTTP_TIMEOUT="60")
        time.sleep(2)  # let the relay settle before its baseline is read
        baseline = rss_bytes(relay.pid)

        producer = Producer({"bootstrap.servers": setup.bootstrap, "message.max.bytes": 2_000_000,
                             "queue.buffering.max.kbytes": 400_000})
        padding = "x" * SIZE
        # In chunks, as a live producer would: the dev broker answers a fetch with all
        # it has, whatever the consumer's fetch.max.bytes, so one 180 MB answer would
        # measure the broker, not the relay. Paused partitions are not fetched at all.
        for chunk in range(0, MESSAGES, 8):
            for n in range(chunk, chunk + 8):
                setup.publish(request(input={"pad": padding}, dispatch_key=f"big-{n}"),
                              producer=producer, flush=False)
            assert producer.flush(60) == 0
            time.sleep(0.3)

        try:
            wait_until(lambda: metric(metrics_url, "poimen_inbox_buffered_bytes") >= BUDGET,
                       timeout=60, what="the relay to fill its budget")
        except AssertionError as err:
            raise AssertionError(
                f"{err}; held {metric(metrics_url, 'poimen_inbox_buffered_bytes')}\n"
                f"{relay.log()[-2000:]}") from None
        peak = 0
        held = 0.0
        end = time.monotonic() + 8  # keep watching: fetching must stay paused
        while time.monotonic() < end:
            peak = max(peak, rss_bytes(relay.pid))
            held = max(held, metric(metrics_url, "poimen_inbox_buffered_bytes"))
            time.sleep(0.2)
        # Four partitions, one message in flight each, may each add one message at the
        # moment the budget is reached; librdkafka's prefetch queue is a quarter of it.
        assert held <= BUDGET + 4 * (SIZE + 1024), held
        margin = 48 * 1024 * 1024
        assert peak - baseline < BUDGET + margin, (
            f"relay RSS grew {(peak - baseline) / 2**20:.0f} MiB (budget {BUDGET / 2**20:.0f} "
            f"MiB); baseline {baseline / 2**20:.0f} MiB")
    finally:
        server.shutdown()
        os.environ.get("PATH")  # nothing else to undo: the relay is stopped by the fixture
