"""Topic names and declaration: ``python -m bridge.topics declare|publish``.

Each tenant has three topics: ``<prefix>.<tenant>.dispatch`` (spawn requests the
inbox turns into runs), ``<prefix>.<tenant>.dispatch.dlq`` (what the inbox could
not admit) and ``<prefix>.<tenant>.events`` (what the outbox publishes).
Declaring is idempotent: a topic that already exists is left as it is.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

# The prefix (POIMEN_TOPIC_PREFIX after Heroku's KAFKA_PREFIX) and the client
# settings are read by poimenconfig; the names below are built from what it read.
from poimenconfig import (
    DEFAULT_TOPIC_PARTITIONS,
    kafka_client_settings,
    topic_prefix,
    topic_replication,
)

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def dispatch_topic(prefix: str, tenant: str) -> str:
    return f"{prefix}.{tenant}.dispatch"


def dead_letter_topic(prefix: str, tenant: str) -> str:
    return f"{prefix}.{tenant}.dispatch.dlq"


def events_topic(prefix: str, tenant: str) -> str:
    return f"{prefix}.{tenant}.events"


def tenant_topics(prefix: str, tenant: str) -> list[str]:
    """Return every topic of ``tenant``."""
    return [dispatch_topic(prefix, tenant), dead_letter_topic(prefix, tenant),
            events_topic(prefix, tenant)]


def ensure_topics(admin: AdminClient, names: Iterable[str], partitions: int,
                  replication_factor: int = -1, timeout: float = 30.0) -> list[str]:
    """Create the topics in ``names`` that do not exist; return the ones created.

    ``replication_factor=-1`` lets the broker apply its default, so the same call
    suits a one-node dev broker and a replicated production cluster.
    """
    names = list(dict.fromkeys(names))
    if not names:
        return []
    futures = admin.create_topics(
        [NewTopic(n, num_partitions=partitions, replication_factor=replication_factor)
         for n in names],
        request_timeout=timeout,
    )
    created = []
    for name, future in futures.items():
        try:
            future.result(timeout)
            created.append(name)
        except KafkaException as err:
            if err.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    return created


def topic_max_message_bytes(admin: AdminClient, topic: str, timeout: float = 5.0) -> int:
    """The broker's limit for a record batch on ``topic``: its ``max.message.bytes``
    (the broker's ``message.max.bytes`` unless the topic sets its own). Raises
    ``KafkaException`` when the broker does not answer or refuses (no DescribeConfigs ACL)."""
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    [future] = admin.describe_configs([resource], request_timeout=timeout).values()
    return int(future.result(timeout)["max.message.bytes"].value)


def declare_topics(bootstrap: str, prefix: str, tenants: Iterable[str], partitions: int,
                   settings: Mapping[str, str] | None = None,
                   replication_factor: int = -1) -> list[str]:
    """Create the dispatch, dead-letter and events topics of each tenant; return those created.

    ``settings`` are extra librdkafka settings (security, SASL) for the admin client;
    ``replication_factor`` is ``POIMEN_TOPIC_REPLICATION`` (-1: the broker's default).
    """
    tenants = list(tenants)
    for tenant in tenants:
        if not TENANT_NAME.match(tenant):
            raise ValueError(f"{tenant!r} is not a tenant name (a-z, 0-9, '_', '-')")
    admin = AdminClient({**(settings or {}), "bootstrap.servers": bootstrap})
    names = [topic for tenant in tenants for topic in tenant_topics(prefix, tenant)]
    return ensure_topics(admin, names, partitions, replication_factor=replication_factor)


def publish_dispatch(settings: Mapping[str, str], prefix: str, tenant: str,
                     request: Mapping[str, object], key: str | None = None,
                     timeout: float = 30.0) -> None:
    """Publish one dispatch message (a run request) and wait for the broker's acknowledgement."""
    errors: list[KafkaError] = []
    producer = Producer({**settings, "acks": "all"})
    producer.produce(dispatch_topic(prefix, tenant), json.dumps(dict(request)).encode(),
                     key=key.encode() if key else None,
                     on_delivery=lambda err, _msg: errors.append(err) if err else None)
    if producer.flush(timeout) or errors:
        raise SystemExit(f"publish failed: {errors[0] if errors else 'not acknowledged in time'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge.topics", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    declare = sub.add_parser("declare", help="create a tenant's topics (idempotent)")
    declare.add_argument("--tenant", action="append", required=True, dest="tenants",
                         help="tenant name; repeat for several")
    declare.add_argument("--partitions", type=int, default=DEFAULT_TOPIC_PARTITIONS)
    publish = sub.add_parser("publish", help="publish one dispatch message (a console producer)")
    publish.add_argument("--tenant", required=True)
    publish.add_argument("--workflow-ref", required=True)
    publish.add_argument("--input", default="{}", help="a JSON object")
    publish.add_argument("--dispatch-key")
    publish.add_argument("--goal-id")
    publish.add_argument("--key", help="message key (default: <tenant>:<dispatch key>)")
    args = parser.parse_args(argv)

    settings = kafka_client_settings()
    prefix = topic_prefix()
    if args.command == "declare":
        created = declare_topics(settings["bootstrap.servers"], prefix, args.tenants,
                                 args.partitions, settings, topic_replication())
        for tenant in args.tenants:
            for topic in tenant_topics(prefix, tenant):
                print(f"{topic}\t{'created' if topic in created else 'exists'}")
    elif args.command == "publish":
        request: dict[str, object] = {"workflow_ref": args.workflow_ref,
                                      "input": json.loads(args.input)}
        if args.dispatch_key:
            request["dispatch_key"] = args.dispatch_key
        if args.goal_id:
            request["goal_id"] = args.goal_id
        publish_dispatch(settings, prefix, args.tenant, request,
                         key=args.key or (f"{args.tenant}:{args.dispatch_key}"
                                          if args.dispatch_key else None))
        print(f"published to {dispatch_topic(prefix, args.tenant)}: {json.dumps(request)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
