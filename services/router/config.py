"""Router settings: every field a --flag and an EPD_ROUTER_* variable."""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.common.config import check
from services.router.api.image_urls import PREFIX as IMAGE_URL_PREFIX
from services.router.policies import POLICIES

_ORIGIN = re.compile(r"\*|[a-z][a-z0-9+.-]*://[^/\s]+")
"""A CORS origin as browsers send it: scheme://host[:port], no path; or * (any)."""


@dataclass(frozen=True)
class RouterConfig:
    """The HTTP front door: OpenAI API in, prefill and decode instances over gRPC behind it."""

    host: str = "127.0.0.1"
    """Address the HTTP server binds to; 0.0.0.0 in a container."""
    port: int = 8000
    """HTTP port (the OpenAI API, /health, /metrics); 0 picks a free one."""
    prefill: tuple[str, ...] = ()
    """gRPC addresses of the prefill instances (comma-separated or repeated); none: the router
    waits (up to connect_timeout_s) for instances from discovery or POST /admin/instances."""
    decode: tuple[str, ...] = ()
    """gRPC addresses of the decode instances."""
    encoder: tuple[str, ...] = ()
    """gRPC addresses of the encoder instances; none: images are refused."""
    discovery: str = "static"
    """Where instances come from besides the admin API: static (the --prefill / --decode /
    --encoder addresses) or kubernetes (the EndpointSlices of the role Services, watched; the
    addresses given are kept too)."""
    k8s_namespace: str = ""
    """Namespace whose EndpointSlices are watched; empty: the pod's own (else "default")."""
    k8s_label_selector: str = ""
    """Label selector of the role Services' EndpointSlices (e.g. app.kubernetes.io/instance=epd);
    the role comes from their epd.io/role label."""
    k8s_resync_s: float = 30.0
    """Seconds between two full re-lists of the EndpointSlices (besides the watch)."""
    planner: str = "off"
    """The planner (replicas per role from this router's signals): off; external (publish the
    desired replicas as the epd_planner_desired_replicas gauge and in GET /admin/planner, for
    KEDA / an HPA); launcher (the same, for epd up --autoscale); kubernetes (patch each role's
    workload scale). Run it in one router only."""
    planner_config: str = ""
    """JSON file of the planner's settings (SLOs, targets, windows, min/max per role); empty: defaults."""
    kvstore: tuple[str, ...] = ()
    """gRPC addresses of the KV store nodes whose capacity use the planner follows."""
    leave_timeout_s: float = 60.0
    """How long an instance that left (Kubernetes, the admin API) keeps the router's requests
    already on it before it is dropped whatever they are."""
    served_model_name: tuple[str, ...] = ()
    """Extra names clients may use for the model (its own name always works)."""
    connect_timeout_s: float = 120.0
    """How long to wait at start for a prefill or decode instance to describe the model."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long open requests get to finish."""
    prefill_policy: str = "prefill_buckets"
    """Prefill balancer: prefill_buckets (SPEC's length buckets), or a baseline: round_robin,
    least_requests, power_of_two, cache_aware."""
    decode_policy: str = "decode_balance"
    """Decode balancer: decode_balance (requests and KV length at once), or a baseline."""
    encoder_policy: str = "encoder_balance"
    """Encoder balancer: encoder_balance (random machine, fewest patches in flight), or a baseline."""
    bucket_bounds: tuple[int, ...] = ()
    """Prefill buckets' prompt-length bounds (3 ascending, in tokens); empty: SPEC's
    16K / 64K / 256K scaled to the model's context."""
    bucket_caps: tuple[int, ...] = ()
    """Most prefill instances per bucket (4 numbers, 0: no cap); empty: no caps."""
    round_s: float = 10.0
    """Seconds between two reallocations of prefill instances to buckets."""
    room_s: float = 0.1
    """Prefill requests wait in the router's per-bucket queues until an instance of their
    bucket has at most this many seconds of prefill queued."""
    health_timeout_s: float = 3.0
    """An instance with no load report for this long gets no new requests."""
    decode_idle_timeout_s: float = 5.0
    """A decode stream that sends nothing for this long (decode instances send a heartbeat
    every second while busy) counts as frozen: its request moves to another instance."""
    stage_timeout_s: float = 600.0
    """Deadline of one Prefill or Encode call: past it the request fails with 504 and the
    instance counts a failure (a frozen instance does not hold requests forever). Long prompts
    on slow engines need it above their prefill time."""
    max_migrations: int = 3
    """How many times one request may move to another decode instance mid-stream (its stream
    broke or went silent) before it fails."""
    admin_host: str = "127.0.0.1"
    """Address the admin API binds to (keep it private)."""
    admin_port: int | None = 8001
    """Admin API port; 0 picks a free one, none disables it."""
    admin_token: str = ""
    """Bearer token of the admin API; empty: the admin API is off."""
    api_keys: tuple[str, ...] = ()
    """API keys clients must send (Authorization: Bearer KEY or x-api-key: KEY): KEY (tenant
    "default") or TENANT:KEY, comma-separated. Set EPD_ROUTER_API_KEYS, not the flag: anyone on
    the machine can read a command line. Only their sha256 is kept (in the keys file or Redis);
    checked at start, where an error does not echo them."""
    api_keys_file: str = ""
    """JSON file of API keys (hashed) and their limits; `epd admin keys create` adds to it."""
    redis_url: str = ""
    """Redis for API keys and per-key limits shared by several routers (epd up --redis). While it
    is down, keys this router has seen keep working and unseen keys get 503."""
    key_cache_ttl_s: float = 5.0
    """With Redis: how long a key's record read from Redis is trusted before it is read again
    (a revoke reaches every router within this), and how often the router asks whether any key
    exists while none does."""
    limits_on_redis_failure: str = "fail-open"
    """What per-key limits do while Redis cannot answer: fail-open admits, each router enforcing
    the limits on its own (best effort); fail-closed answers 503 with Retry-After to keys that
    have limits."""
    rpm: int = 0
    """Requests per minute per API key, for keys without their own limit; 0: unlimited."""
    tpm: int = 0
    """Tokens (prompt + generated) per minute per API key, for keys without their own; 0: unlimited."""
    max_concurrency: int = 0
    """Requests in flight at once per API key, for keys without their own; 0: unlimited."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body accepted (413 beyond)."""
    allow_unauthenticated: bool = False
    """Serve the API without keys on a non-loopback host (refused otherwise)."""
    cors_allow_origin: tuple[str, ...] = ()
    """Browser origins allowed to call the API (CORS), e.g. https://app.example.com, or * for
    any; none: no CORS headers, browsers refuse cross-origin calls. Preflights are answered
    before API keys are checked; the calls themselves still need a key."""
    allow_image_urls: tuple[str, ...] = ()
    """URL prefixes (scheme://host[:port]/path...) the router fetches images from when a message
    names one by http(s) URL; none: remote image URLs are refused with a 400."""
    image_url_max_bytes: int = 20 * 1024 * 1024
    """Largest image fetched from an allowed URL (a 400 beyond)."""
    image_url_timeout_s: float = 10.0
    """Time for the whole fetch of one image from an allowed URL (a 400 beyond)."""

    def __post_init__(self) -> None:
        check(0 <= self.port <= 65535, "port", "must be in 0..65535 (0: a free port)")
        check(self.discovery in ("static", "kubernetes"), "discovery", "must be static or kubernetes")
        check(self.k8s_resync_s > 0, "k8s_resync_s", "must be > 0")
        check(self.planner in ("off", "external", "launcher", "kubernetes"), "planner",
              "must be off, external, launcher or kubernetes")
        check(self.leave_timeout_s >= 0, "leave_timeout_s", "must be >= 0")
        check(self.connect_timeout_s > 0, "connect_timeout_s", "must be > 0")
        for field in ("prefill_policy", "decode_policy", "encoder_policy"):
            check(getattr(self, field) in POLICIES, field,
                  f"unknown policy {getattr(self, field)!r}; known: {', '.join(sorted(POLICIES))}")
        check(not self.bucket_bounds or (len(self.bucket_bounds) == 3 and 0 < self.bucket_bounds[0]
                                         < self.bucket_bounds[1] < self.bucket_bounds[2]),
              "bucket_bounds", "needs 3 ascending positive token counts")
        check(not self.bucket_caps or (len(self.bucket_caps) == 4 and min(self.bucket_caps) >= 0),
              "bucket_caps", "needs 4 numbers >= 0 (0: no cap)")
        check(self.round_s > 0, "round_s", "must be > 0")
        check(self.room_s >= 0, "room_s", "must be >= 0")
        check(self.health_timeout_s > 0, "health_timeout_s", "must be > 0")
        check(self.decode_idle_timeout_s > 0, "decode_idle_timeout_s", "must be > 0")
        check(self.stage_timeout_s > 0, "stage_timeout_s", "must be > 0")
        check(self.max_migrations >= 0, "max_migrations", "must be >= 0 (0: a broken stream fails its request)")
        check(self.admin_port is None or 0 <= self.admin_port <= 65535, "admin_port",
              "must be in 0..65535 (0: a free port) or none")
        for field in ("rpm", "tpm", "max_concurrency"):
            check(getattr(self, field) >= 0, field, "must be >= 0 (0: unlimited)")
        check(self.max_body_bytes > 0, "max_body_bytes", "must be > 0")
        check(self.key_cache_ttl_s > 0, "key_cache_ttl_s", "must be > 0")
        check(self.limits_on_redis_failure in ("fail-open", "fail-closed"), "limits_on_redis_failure",
              "must be fail-open or fail-closed")
        for prefix in self.allow_image_urls:
            check(IMAGE_URL_PREFIX.fullmatch(prefix) is not None, "allow_image_urls",
                  f"{prefix!r} is not a URL prefix: http(s)://host[:port]/ and an optional path")
        check(self.image_url_max_bytes > 0, "image_url_max_bytes", "must be > 0")
        check(self.image_url_timeout_s > 0, "image_url_timeout_s", "must be > 0")
        for origin in self.cors_allow_origin:
            check(_ORIGIN.fullmatch(origin) is not None, "cors_allow_origin",
                  f"{origin!r} is not an origin: scheme://host[:port] without a path (or * for any)")
        check(not (self.api_keys_file and self.redis_url), "api_keys_file",
              "is a second key store next to --redis-url / EPD_ROUTER_REDIS_URL: choose one")
