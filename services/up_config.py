"""``epd up``'s settings (one frozen dataclass, its flags) and the free ports it starts children on."""

from __future__ import annotations

import os
import random
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from kvstore.swa import DEFAULT_SWA_TTL_S
from kvstore.transfer.engine import TRANSPORT_CHOICES
from services.common.config import check
from services.common.errors import InvalidRequestError
from services.engine.models.config import is_llava_dir
from services.engine.threads import parse_cpus


VLLM_PYTHON_ENV = "EPD_VLLM_PYTHON"


def vllm_python() -> str:
    """The interpreter of vLLM's venv (``make setup-vllm``; ``EPD_VLLM_PYTHON`` names another)."""
    return os.environ.get(VLLM_PYTHON_ENV) or str(Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python")


@dataclass(frozen=True)
class UpConfig:
    """Start a local epd cluster: encoders, prefills, decodes and the router."""

    model: str = ""
    """Model name, GGUF file or Hugging Face directory; empty: SmolLM2-135M-Instruct."""
    encoders: int | None = None
    """Encoder instances (images in messages); none: auto, one for a LLaVA model directory (its
    vision tower) and none otherwise, so a text-only model answers images with a 400. For a text
    model with encoders, their tower is random unless EPD_ENCODER_WEIGHTS names weights."""
    prefills: int = 1
    """Prefill instances."""
    decodes: int = 1
    """Decode instances."""
    host: str = "127.0.0.1"
    """Address every process binds to."""
    port: int = 8000
    """The router's HTTP port (the OpenAI API)."""
    kv_cache_gib: float = 1.0
    """KV pool per prefill / decode instance."""
    max_num_batched_tokens: int = 2048
    """Per-step token budget of each engine (the prefill chunk size)."""
    device: str = "auto"
    """"cpu", "cuda" or "auto" for every engine."""
    dtype: str = "auto"
    """Every engine's dtype: "float32", "bfloat16" or "auto" (see the engines' --dtype)."""
    engine: str = "epd"
    """Prefill and decode instances' engine: epd, or vllm (vLLM's, in .venv-vllm: make setup-vllm;
    on the CPU with vLLM's block size of 128 tokens). The encoder stays epd's."""
    engine_args: str = ""
    """With engine vllm, a JSON object of vLLM's engine arguments for every instance
    (AsyncEngineArgs: tensor_parallel_size, quantization, enable_lora, max_model_len...)."""
    batch_invariant: bool = False
    """Every engine must give a request's output bit for bit alone or in any batch, kill -9
    migration included (the engines' --batch-invariant): the CPU's kernels hold it by default;
    set, an engine that cannot (CUDA, exact prefill, no C compiler) refuses to start."""
    cpu_threads: str = "prefill"
    """CPU engines' compute threads: "prefill" (prefill engines bind a thread to each CPU, decode
    engines' threads unbound: the OS moves them to whichever CPU is free), "off" (every engine
    unbound: the OS shares this machine's CPUs among them), "split" (each prefill and decode
    process started with the cluster gets its own equal share of the CPUs, its threads bound
    there, when there are at least as many CPUs as those processes; otherwise, and for
    processes scaled out later, off), or "auto" (every engine binds to all of them). See
    services/engine/threads.py and its measurements."""
    decode_nice: int = 10
    """Priority (nice, 0-19) of CPU decode engines' compute threads: on CPUs shared with prefill
    they yield to it, whose steps set time to first token, while a decode step has slack in its
    inter-token latency. 0: equal priority."""
    startup_timeout_s: float = 600.0
    """How long the instances get to load the model and report healthy."""
    stop_timeout_s: float = 30.0
    """On Ctrl-C / SIGTERM, how long children get to drain before SIGKILL."""
    kvstores: int = 1
    """KV store nodes (shared prefix KV for every prefill); 0: none, each instance only has
    its own prefix cache."""
    redis: str = ""
    """Redis URL the store nodes share their block indexes through; empty: each node keeps its
    index in its own memory."""
    kvstore_replicas: int = 1
    """Store nodes each block is written to (2 survives the loss of a node)."""
    kvstore_capacity_mib: int = 1024
    """Host-memory tier of each store node."""
    kvstore_dir: str = ""
    """Directory for the store nodes' disk tiers (kept across restarts, one subdirectory per
    node); empty: ~/.cache/epd/kvstore; "none": memory only."""
    kvstore_disk_gib: float = 8.0
    """Disk tier of each store node."""
    swa_ttl_s: float = DEFAULT_SWA_TTL_S
    """How long a hybrid model's sliding windows stay readable in the SWA tier (the instance that
    computed one keeps it, the store names it); past it a prompt replays its window."""
    kv_transport: str = "auto"
    """How engines and store nodes read each other's KV: auto (shared memory on this machine),
    shm, tcp (over TCP, as between machines) or nixl (NIXL over UCX, where it is installed)."""
    prefill_policy: str = ""
    """The router's prefill balancer (e.g. round_robin); empty: its default, prefill_buckets."""
    decode_policy: str = ""
    """The router's decode balancer; empty: its default, decode_balance."""
    admin_port: int = 8001
    """The router's admin API port (on 127.0.0.1)."""
    admin_token: str = ""
    """Bearer token of the admin API; empty: a random one, printed at start."""
    api_key: tuple[str, ...] = ()
    """An API key the router requires, KEY or TENANT:KEY (repeat the flag for more; EPD_UP_API_KEY
    keeps them off this command line too); it reaches the router by environment, never its
    command line. None, no keys file, no Redis keys: the API is open to anyone on this machine."""
    api_keys: str = ""
    """The router's API keys file (JSON, hashed keys; created by `epd admin keys create`)."""
    autoscale: bool = False
    """Let the router's planner scale prefill, decode and encoder processes while the cluster
    runs: epd up starts the ones it asks for and drains, then stops, the ones it no longer needs."""
    planner_config: str = ""
    """The planner's settings (JSON file: targets, SLOs, min/max per role, windows); empty: its
    defaults, prefill and decode scaled between --prefills / --decodes and --autoscale-max."""
    autoscale_max: int = 4
    """With --autoscale and no --planner-config: the most prefill, and decode, processes."""
    ray: bool = False
    """Run every process as a Ray actor (services/ray_cluster): placed by Ray resources, restarted by Ray."""
    ray_address: str = ""
    """With --ray: the Ray cluster (host:port, or auto); empty: RAY_ADDRESS, else a local Ray."""
    ray_gpus_per_engine: float = 1.0
    """With --ray, on a cluster with GPUs and --device not cpu: GPUs each encoder / prefill / decode
    actor reserves (0.5: two engines share one GPU)."""

    def __post_init__(self) -> None:
        check(self.encoders is None or self.encoders >= 0, "encoders", "must be >= 0 (none: auto)")
        check(self.engine in ("epd", "vllm"), "engine", "must be epd or vllm")
        check(self.engine != "vllm" or Path(vllm_python()).exists(), "engine",
              f"vllm: {vllm_python()} is missing; vLLM has a venv of its own: run `make setup-vllm`")
        check(not self.engine_args or self.engine == "vllm", "engine_args", "is for --engine vllm only")
        check(not (self.ray and self.engine != "epd"), "engine", f"{self.engine} does not run under --ray yet")
        if self.cpu_threads not in ("split", "prefill"):
            try:
                parse_cpus(self.cpu_threads)
            except InvalidRequestError as exc:
                check(False, "cpu_threads", f"{exc} (or split, or prefill)")
        check(0 <= self.decode_nice <= 19, "decode_nice", "must be in 0..19")
        check(self.prefills >= 1, "prefills", "needs at least one prefill instance")
        check(self.decodes >= 1, "decodes", "needs at least one decode instance")
        check(self.swa_ttl_s > 0, "swa_ttl_s", "must be > 0")
        check(self.kv_transport in TRANSPORT_CHOICES, "kv_transport", f"must be one of {', '.join(TRANSPORT_CHOICES)}")
        check(0 <= self.port <= 65535, "port", "must be in 0..65535")
        check(self.kvstores >= 0, "kvstores", "must be >= 0")
        check(1 <= self.kvstore_replicas <= max(1, self.kvstores), "kvstore_replicas",
              "must be between 1 and the number of store nodes")
        check(not self.autoscale or self.autoscale_max >= max(self.prefills, self.decodes), "autoscale_max",
              "must be >= --prefills and --decodes")
        check(not self.ray_address or self.ray, "ray_address", "needs --ray")
        check(0 < self.ray_gpus_per_engine <= 8, "ray_gpus_per_engine", "must be in (0, 8]")
        check(not (self.api_keys and self.redis), "api_keys", "with --redis the router keeps its keys in "
              "Redis: drop the keys file (give --api-key, or add keys with epd admin keys create)")

    @property
    def num_encoders(self) -> int:
        """--encoders, auto resolved: one for a LLaVA directory, none for a text model."""
        if self.encoders is not None:
            return self.encoders
        return 1 if is_llava_dir(self.model) else 0

    def kvstore_disk_dir(self, node: int) -> str:
        if self.kvstore_dir == "none":
            return ""
        root = Path(self.kvstore_dir) if self.kvstore_dir else Path(
            os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "epd" / "kvstore"
        return str(root / f"kvstore-{node}")


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port(host: str) -> int:
    """A port that is free now, from below the kernel's ephemeral range: a child binds it only
    after loading its model, and meanwhile sockets bound to port 0 (data servers, clients) must
    not take it. A process never gets the same port twice: a child that has not bound its port
    yet leaves it free, and a second draw of it would start two children on one port."""
    low = _ephemeral_low()
    with _handed_out_lock:
        for _ in range(200):
            port = random.randrange(max(1024, low - 12000), low)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port below {low} on {host}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
