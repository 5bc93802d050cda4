"""``lmc serve MODEL --replicas N`` (or ``--autoscale MIN:MAX``), assembled:
Ray started on loopback (or joined at ``--ray-address`` / ``RAY_ADDRESS``),
the engine replicas deployed on Ray Serve with the cache-aware router, and
the same API app as the single-process server over a ``RayBackend``. This
process is the ingress: uvicorn serves the app here (``serve.server.serve``)
and calls the replicas through the deployment handle, which is where Serve
runs the router. Serve's own HTTP proxy is not started.

The first replica compiles (or finds the artifact in the shared cache,
``LMC_CACHE_DIR``); the others are added once it is up, so they start warm
from what it compiled.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from compiler.host_cores import usable_cores
from ir.types import DEFAULT_KV_TYPE

from ..errors import RunError
from ..serve.server import ServerOptions, viz_builder, with_template

#: seconds between a replica's published stats (block hashes, load, metrics) reaching the router
STATS_PERIOD_S = 0.5
DEPLOYMENT = "lmc-engine"


def app_name() -> str:
    """This server's Serve application: one per ingress, so that two lmc
    servers on one cluster never replace each other's replicas."""
    return f"lmc-{os.getpid()}"


@dataclass
class ClusterOptions:
    #: a fixed number of replicas, or None with ``autoscale``
    replicas: int | None = None
    #: (min, max) replicas, scaled on ongoing requests per replica
    autoscale: tuple[int, int] | None = None
    #: an existing cluster (None: RAY_ADDRESS, else a local Ray on loopback)
    ray_address: str | None = None
    #: seconds of low load before a replica is removed
    downscale_delay_s: float = 60.0
    upscale_delay_s: float = 5.0
    #: thresholds beyond which loads count as uneven (``affinity``)
    balance_abs: int = 4
    balance_rel: float = 1.5
    #: ``cache`` or ``power-of-two`` (``router.CacheAffinityRouter``)
    routing: str = "cache"


class ReplicaSet:
    """What ``serve.server.serve`` starts, drains and stops in place of one engine."""

    def __init__(self, backend: Any, started_ray: bool) -> None:
        self.backend = backend
        self.started_ray = started_ray

    def start(self) -> "ReplicaSet":
        return self

    def drain(self, grace_s: float) -> None:
        self.backend.drain(grace_s)

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            serve.delete(app_name())
            if self.started_ray:
                serve.shutdown()
        finally:
            if self.started_ray:
                ray.shutdown()


@dataclass
class ClusterServing:
    app: Any
    engine: ReplicaSet
    model_id: str
    replicas: str
    address: str
    info: Any
    threads: int
    parallel: int

    def banner(self, host: str, port: int) -> str:
        url_host = f"[{host}]" if ":" in host else host
        m = self.info.meta or {}
        return (f"lmc serve: {self.model_id} on http://{url_host}:{port} ({self.replicas} on Ray at {self.address}, "
                f"each: parallel {self.parallel}, context {self.info.ctx}, KV pool {m.get('kv_blocks')} blocks x "
                f"{m.get('block_size')} {m.get('kv_type')}, {self.threads} threads)")


def check_reachable(address: str, what: str = "--ray-address") -> None:
    """A cluster address (``host:port`` or ``ray://host:port``) that nothing
    answers at is one clear error now (Ray itself retries for minutes)."""
    import socket

    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return   # "auto" and other forms: Ray resolves them
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise RunError(f"{what} {address}: no Ray there ({e.strerror or e})") from None


def replica_threads(opts: ServerOptions, c: ClusterOptions) -> int:
    """Threads per replica: ``-t``, else the cores split between the replicas that start."""
    if opts.threads:
        return opts.threads
    n = c.replicas or (c.autoscale[1] if c.autoscale else 1)
    return max(1, usable_cores() // n)


def build_cluster(opts: ServerOptions, c: ClusterOptions, status: Callable[[str], None] | None = None
                  ) -> ClusterServing:
    """Start (or join) Ray, deploy the replicas, and assemble the ingress app."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, RequestRouterConfig

    from compiler.driver import load_model

    from ..serve.app import create_app
    from .backend import RayBackend
    from .metrics import IngressMetrics
    from .replica import EngineReplica
    from .router import CacheAffinityRouter

    say = status or (lambda _: None)
    tok = with_template(load_model(opts.model, opts.tokenizer).tokenizer, opts)   # bad templates fail here, once
    threads = replica_threads(opts, c)
    opts = ServerOptions(**{**opts.__dict__, "threads": threads,
                            "model": os.path.abspath(opts.model),
                            "tokenizer": os.path.abspath(opts.tokenizer) if opts.tokenizer else None})
    address = c.ray_address or os.environ.get("RAY_ADDRESS") or None
    env = {k: v for k, v in os.environ.items() if k.startswith("LMC_")}
    started = not ray.is_initialized()
    if started and address is not None:
        check_reachable(address, "--ray-address" if c.ray_address else "$RAY_ADDRESS")
    if started:
        say("starting Ray" if address is None else f"joining Ray at {address}")
        kw: dict[str, Any] = {"include_dashboard": False, "logging_level": "WARNING", "log_to_driver": False,
                              "runtime_env": {"env_vars": env} if env else None}
        if address is None:   # a Ray of our own, even if another runs here
            kw.update(num_cpus=usable_cores(), _node_ip_address="127.0.0.1")
        try:
            ray.init(address=address or "local", **kw)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise RunError(f"--ray-address {address}: {e}") from None
    serve.start(http_options=HTTPOptions(location="NoServer"))
    first = c.autoscale[0] if c.autoscale else 1
    want = c.replicas or first
    router = RequestRouterConfig(request_router_class=CacheAffinityRouter,
                                 request_router_kwargs={"block_size": opts.block_size, "balance_abs": c.balance_abs,
                                                        "balance_rel": c.balance_rel, "policy": c.routing},
                                 request_routing_stats_period_s=STATS_PERIOD_S, request_routing_stats_timeout_s=10)
    options: dict[str, Any] = dict(name=DEPLOYMENT, ray_actor_options={"num_cpus": threads},
                                   max_ongoing_requests=opts.parallel + opts.queue, health_check_period_s=2,
                                   health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
                                   request_router_config=router)

    def deploy(n: int | None) -> Any:
        o = dict(options)
        if c.autoscale is not None:
            lo, hi = c.autoscale
            o["autoscaling_config"] = {"min_replicas": lo, "initial_replicas": n, "max_replicas": hi,
                                       "target_ongoing_requests": opts.parallel, "metrics_interval_s": 1.0,
                                       "look_back_period_s": 5.0, "upscale_delay_s": c.upscale_delay_s,
                                       "downscale_delay_s": c.downscale_delay_s}
        else:
            o["num_replicas"] = n
        return serve.run(serve.deployment(EngineReplica).options(**o).bind(opts), name=app_name(),
                         route_prefix=None)

    say(f"compiling on the first replica ({threads} threads)")
    handle = deploy(first)
    if want > first:
        say(f"starting {want - first} more replica(s) from the compiled artifact")
        handle = deploy(want)
    info = handle.info.remote().result()
    replicas = f"{c.replicas} replicas" if c.replicas else f"autoscaling {c.autoscale[0]}..{c.autoscale[1]} replicas"
    info.meta = {**(info.meta or {}), "replicas": c.replicas, "autoscale": list(c.autoscale) if c.autoscale else None}
    backend = RayBackend(handle, tok, info, IngressMetrics())
    app = create_app(backend, api_key=opts.api_key, webui=opts.webui,
                     viz=viz_builder(opts, info.ctx, (info.meta or {}).get("kv_type") or DEFAULT_KV_TYPE))
    where = ray.get_runtime_context().gcs_address
    return ClusterServing(app, ReplicaSet(backend, started), info.model_id, replicas, where, info, threads,
                          opts.parallel)
