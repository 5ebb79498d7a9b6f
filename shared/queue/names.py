"""Every Redis key name Conveyor uses, in one place."""

from __future__ import annotations

from shared.roles import Role

PREFIX = "conveyor"

JOB_GROUP = "workers"
"""Consumer group every job stream has."""

COMMAND_CHANNEL = f"{PREFIX}:commands"
"""Pub/sub channel carrying commands (cancel) to every worker (db 0)."""


def command_channel(db: int) -> str:
    """Pub/sub channels are server-wide, not per db: keep deployments on other dbs apart."""
    return COMMAND_CHANNEL if db == 0 else f"{COMMAND_CHANNEL}:{db}"


_JOBS = f"{PREFIX}:jobs:"


def job_stream(model: str, role: Role) -> str:
    """One shared stream per (model, role): the pool's queue, read by all its workers."""
    return f"{_JOBS}{model}:{role}"


def worker_job_stream(shared_stream: str, worker_id: str) -> str:
    """A worker's own job stream in the pool of ``shared_stream``: jobs placed on it. Its
    own prefix, so nothing that suffixes the shared streams (``:dead``, ``:done``) meets
    it; a job read from it counts, dead-letters and hands back on the shared one."""
    return f"{PREFIX}:placed:{shared_stream.removeprefix(_JOBS)}:{worker_id}"


def placed_workers(shared_stream: str) -> str:
    """Set: the workers of the pool of ``shared_stream`` that may have an own job stream
    (admission counts their depth; the janitors requeue the streams of the dead ones)."""
    return f"{PREFIX}:placed-workers:{shared_stream.removeprefix(_JOBS)}"


def steal_tickets(shared_stream: str) -> str:
    """Stream: one ticket per request placed in the pool of ``shared_stream`` (naming its
    worker), read by the pool's workers with free slots through :data:`JOB_GROUP`: each
    ticket wakes one of them, which steals the job if it is still unread when due."""
    return f"{PREFIX}:steal:{shared_stream.removeprefix(_JOBS)}"


def dead_letter_stream(job_stream_name: str) -> str:
    """Jobs that failed too often, with their last error."""
    return f"{job_stream_name}:dead"


def stream_done_counter(job_stream_name: str) -> str:
    """Jobs completed from a stream (the gateway derives the drain rate from it)."""
    return f"{job_stream_name}:done"


def job_run(job_id: str, role: Role) -> str:
    """Hash: the owning run's fence token, number of starts, next seq (one per role)."""
    return f"{PREFIX}:run:{role}:{job_id}"


RUN_PATTERN = f"{PREFIX}:run:*"


def job_of_run(run_key: str) -> str:
    return run_key.removeprefix(f"{PREFIX}:run:").split(":", 1)[-1]


def job_emitted(job_id: str, role: Role) -> str:
    """String of int32 token ids already sent to the client."""
    return f"{PREFIX}:emitted:{role}:{job_id}"


_REPLY_PREFIX = f"{PREFIX}:reply:"


def reply_stream(gateway_id: str) -> str:
    """One stream per gateway process; workers XADD token events to it."""
    return f"{_REPLY_PREFIX}{gateway_id}"


def gateway_of_reply_stream(stream: str) -> str:
    return stream.removeprefix(_REPLY_PREFIX)


_REQUEST_HOLDER_PREFIX = "r-"


def request_holder(request_id: str) -> str:
    """The pseudo-gateway id of a resumable request (a background response, a resumable
    stream): its events go to ``reply_stream(request_holder(id))``, its liveness key
    (``gateway_heartbeat(request_holder(id))``) is the lease whoever serves it keeps alive,
    and its usage is opened under it. Workers treat it as any gateway: when the lease has
    been missing for their grace period, they abort the request."""
    return f"{_REQUEST_HOLDER_PREFIX}{request_id}"


def resumable(request_id: str) -> str:
    """Hash: how to read a resumable request's events again on any gateway (its kind,
    its OpenAI body, its key, its times)."""
    return f"{PREFIX}:resumable:{request_id}"


def response_events(response_id: str) -> str:
    """Stream: a background response's rendered events, entry id ``0-{sequence_number+1}``."""
    return f"{PREFIX}:response-events:{response_id}"


BACKGROUND_RESPONSES = f"{PREFIX}:responses:background"
"""Sorted set: running background responses' request ids, scored by their deadline."""


def cancel_flag(request_id: str) -> str:
    return f"{PREFIX}:cancel:{request_id}"


def admitted(request_id: str) -> str:
    """Set when a request's jobs were queued, so a retried admission never queues twice."""
    return f"{PREFIX}:admitted:{request_id}"


def request_status(request_id: str) -> str:
    """A request's status record (shared/queue/request_status.py): written at admission
    and when it ends, read by any gateway for ``GET /v1/requests/{id}``."""
    return f"{PREFIX}:request:{request_id}"


def idempotency(model: str, key: str, owner: str | None = None) -> str:
    """An ``Idempotency-Key`` of one API key (``owner``; None: auth is off): each API key
    has its own namespace, so no key meets (or learns the request ids of) another's."""
    return f"{PREFIX}:idem:{model}:{owner or '-'}:{key}"


def worker_heartbeat(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


WORKER_HEARTBEAT_PATTERN = f"{PREFIX}:worker:*"
"""For tools and tests; the serving path finds workers through :data:`WORKER_SET`."""

WORKER_SET = f"{PREFIX}:workers"
"""Every worker that beat lately (a sorted set: worker id, scored by when its liveness key
expires, in Redis's clock): how readers find the liveness keys without scanning the
keyspace. The key, not the set, says whether a worker lives."""


def gateway_heartbeat(gateway_id: str) -> str:
    return f"{PREFIX}:gateway:{gateway_id}"


def json_schema(request_id: str) -> str:
    """A request's ``response_format`` JSON schema, stored once for all of its jobs."""
    return f"{PREFIX}:schema:{request_id}"


def image(digest: str) -> str:
    """The bytes of a request's image, named by their SHA-256 (the gateway stores them)."""
    return f"{PREFIX}:image:{digest}"


IMAGE_BYTES = f"{PREFIX}:images:bytes"
"""The bytes of all stored images (a counter, against CONVEYOR_IMAGE_STORE_MAX_BYTES)."""
IMAGE_SIZES = f"{PREFIX}:images:sizes"
"""Hash: image digest -> its size, for every image counted in ``IMAGE_BYTES``."""
IMAGE_HOLDS = f"{PREFIX}:images:holds"
"""Hash: image digest -> the open requests holding it (deleted when the last one ends)."""
IMAGE_EXPIRY = f"{PREFIX}:images:expiry"
"""Sorted set: image digest by its key's expiry (ms): expired images are un-counted."""


def image_embedding(model: str, digest: str) -> str:
    """An encode worker's embedding of one image for one model (the redis transport)."""
    return f"{PREFIX}:embedding:{model}:{digest}"


def adapters_desired(base_model: str) -> str:
    """Hash: LoRA adapter name -> its LoraSpec, the adapters every worker of
    ``base_model`` must load (written from SQL by the gateway; see
    shared/queue/lora_registry.py)."""
    return f"{PREFIX}:adapters:{base_model}"


def adapters_generation(base_model: str) -> str:
    """Counter bumped with every write of :func:`adapters_desired` (workers poll it).
    Missing: the desired state is unknown (never published, or lost): workers keep theirs."""
    return f"{PREFIX}:adapters-generation:{base_model}"


def adapter_lock(name: str) -> str:
    """Lock held while adapter ``name`` is registered or removed (one change at a time,
    across gateways and the CLI)."""
    return f"{PREFIX}:lock:adapter:{name}"


def adapters_publish_lock(base_model: str) -> str:
    """Lock held while the SQL registry of ``base_model`` is read and published, so two
    writers cannot publish stale reads over each other."""
    return f"{PREFIX}:lock:adapters-publish:{base_model}"


def command_reply(command_id: str) -> str:
    """List a worker pushes its answer to one admin command onto (short-lived)."""
    return f"{PREFIX}:command-reply:{command_id}"


API_KEYS_GENERATION = f"{PREFIX}:apikeys:generation"
"""Counter bumped after every change to the API keys in SQL; gateways poll it and reload."""

USAGE_STREAM = f"{PREFIX}:usage"
"""Usage records on their way to the SQL ledger (drained by the `ledger` consumer group)."""

USAGE_GROUP = "ledger"

USAGE_DEAD_LETTER = f"{PREFIX}:usage:dead"
"""Usage entries that could not be decoded, kept for an operator instead of dropped."""

LEDGER_RETENTION_LOCK = f"{PREFIX}:ledger:retention"
RESPONSES_RETENTION_LOCK = f"{PREFIX}:responses:retention"
"""Held (SET NX with a TTL) by the one gateway deleting expired ledger rows this period."""


def key_window(key_id: str, limit: str, minute: int) -> str:
    """A key's request or token count in one minute (``limit`` is rpm or tpm)."""
    return f"{PREFIX}:limit:{key_id}:{limit}:{minute}"


def key_concurrency(key_id: str) -> str:
    """Sorted set: a key's open requests, scored by their lease expiry (ms)."""
    return f"{PREFIX}:limit:{key_id}:open"


def key_budget(key_id: str, period: str) -> str:
    """A key's tokens used in one budget period (``d20261124``, ``m202611``)."""
    return f"{PREFIX}:limit:{key_id}:budget:{period}"


def open_requests(gateway_id: str) -> str:
    """Hash: request id -> the usage record's start (shared/queue/open_requests.py), for every
    request the gateway queued and has not recorded usage for yet."""
    return f"{PREFIX}:open-requests:{gateway_id}"


GATEWAY_SET = f"{PREFIX}:gateways"
"""Set: every gateway that queued a request with an open record on this Redis (the
admission script adds it); a sweep removes a dead one once its open requests are closed."""


def sent_tally(request_id: str) -> str:
    """Hash: what workers published for a request, all its sequences together (written by
    the run journal; read only when its gateway died: shared/queue/open_requests.py)."""
    return f"{PREFIX}:sent:{request_id}"


KV_EVENTS_STREAM = f"{PREFIX}:kv-events"
"""Every worker's KV cache events (batches, snapshot notices, leaves), oldest trimmed
(shared/queue/kv_events.py): what the gateways' prefix indexes are fed from."""


def kv_snapshot(worker_id: str) -> str:
    """A worker's last snapshot of its cached blocks (expires with the worker)."""
    return f"{PREFIX}:kv-snapshot:{worker_id}"


KV_SNAPSHOT_PATTERN = f"{PREFIX}:kv-snapshot:*"
