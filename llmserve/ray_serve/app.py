"""`llmserve serve --ray`: llmserve as a Ray Serve application.

  build_application(...)  Ingress (1 replica, the Starlette app of `llmserve serve` over a
                          RayEngineClient) -> Engine (EngineReplica x --num-replicas, or autoscaled
                          between --min-replicas and --max-replicas on ongoing requests), routed
                          by PrefixAwareRouter or by Ray's default router (--request-router)
  run_ray(...)            joins --ray-address / $RAY_ADDRESS, or starts a local Ray instance for
                          the life of the command (Ray's token auth, and its dashboard where
                          ray[default] is installed, so that `ray status` and `ray list actors`
                          work beside it; the log says how); Serve's HTTP proxy listens on --host/--port;
                          SIGTERM or Ctrl-C drains the ingress (as `llmserve serve` does), then
                          deletes the application (and stops a local instance)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
import time

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from sse_starlette.sse import AppStatus

from llmserve.config import EngineConfig, RayConfig, ServerConfig
from llmserve.errors import InvalidRequestError
from llmserve.ray_serve.board import NAMESPACE, board_name
from llmserve.ray_serve.client import RayEngineClient
from llmserve.ray_serve.replica import EngineReplica
from llmserve.server.app import create_app

logger = logging.getLogger("llmserve.ray")
APP_NAME = "llmserve"
DRAIN_SLACK_S = 1.0
PREFIX_ROUTER = "llmserve.ray_serve.router.PrefixAwareRouter"


@serve.ingress()
class Ingress:
    """The HTTP side: everything `llmserve serve` does in its server process."""

    async def __init__(self, engine, engine_config: EngineConfig, server_config: ServerConfig, app_name: str):
        AppStatus.disable_automatic_graceful_drain()  # streams end through the client's abort
        logging.getLogger("llmserve").setLevel(server_config.log_level.upper())
        self.server_config = server_config
        self.client = await RayEngineClient.connect(engine, engine_config, app_name, max_waiting=server_config.max_waiting,
                                                    max_waiting_tokens=server_config.max_waiting_tokens)

    def __serve_build_asgi_app__(self):
        app = create_app(self.client, self.server_config)
        self.server_ctx = app.state.ctx  # (`app` is a name Ray's wrapper takes)
        return app

    async def drain(self) -> None:
        """SIGTERM's drain, as `llmserve serve` does it: new requests get 503, in-flight ones have
        --shutdown-timeout to finish, then each ends with a final "abort" output."""
        self.server_ctx.begin_shutdown()
        deadline = time.monotonic() + max(0.0, self.server_config.shutdown_timeout) + DRAIN_SLACK_S
        while self.client.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(DRAIN_SLACK_S)  # the final chunks reach the proxy and the clients


def build_application(engine_config: EngineConfig, server_config: ServerConfig, ray_config: RayConfig,
                      app_name: str = APP_NAME):
    """The bound application (serve.run takes it)."""
    check(ray_config)
    if engine_config.num_threads is None:  # the replica's share of the CPUs, not the whole machine's
        engine_config = dataclasses.replace(engine_config, num_threads=max(1, int(ray_config.replica_cpus)))
    router = RequestRouterConfig()  # Ray's default: the less loaded of two random replicas
    if ray_config.request_router == "prefix":
        router = RequestRouterConfig(request_router_class=PREFIX_ROUTER, request_router_kwargs={
            "block_size": engine_config.block_size, "prefix_blocks": ray_config.router_prefix_blocks,
            "imbalance": ray_config.router_imbalance})
    engine = serve.deployment(EngineReplica).options(
        name="Engine",
        ray_actor_options={"num_cpus": ray_config.replica_cpus},
        max_ongoing_requests=2 * engine_config.max_num_seqs,  # the running batch, and as many waiting
        request_router_config=router,
        health_check_period_s=2.0,
        # outlives the ingress's drain, which ends every stream with a final "abort" output
        graceful_shutdown_timeout_s=max(0.0, server_config.shutdown_timeout) + 10,
        **_scaling(ray_config),
    ).bind(engine_config, app_name, server_config.log_level)
    replicas = ray_config.max_replicas or ray_config.num_replicas
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},  # I/O-bound; the CPUs are the engines'
        # what the engines take (their own limit above), what may wait (then 429), and room for probes
        max_ongoing_requests=server_config.max_waiting + 2 * engine_config.max_num_seqs * replicas + 64,
        graceful_shutdown_timeout_s=max(0.0, server_config.shutdown_timeout),  # in-flight streams may finish
    )
    return ingress.bind(engine, engine_config, server_config, app_name)


def check(ray_config: RayConfig) -> None:
    if (ray_config.min_replicas is None) != (ray_config.max_replicas is None):
        raise InvalidRequestError("--min-replicas and --max-replicas go together")
    if ray_config.min_replicas is not None and not 0 < ray_config.min_replicas <= ray_config.max_replicas:  # type: ignore[operator]
        raise InvalidRequestError("need 0 < --min-replicas <= --max-replicas")
    if ray_config.num_replicas < 1 or ray_config.replica_cpus <= 0:
        raise InvalidRequestError("--num-replicas must be at least 1 and --replica-cpus positive")
    if ray_config.router_prefix_blocks < 1 or ray_config.router_imbalance < 1 or ray_config.target_ongoing_requests < 1:
        raise InvalidRequestError("--router-prefix-blocks, --router-imbalance and --target-ongoing-requests must be at least 1")


def _scaling(ray_config: RayConfig) -> dict:
    if ray_config.min_replicas is None:
        return {"num_replicas": ray_config.num_replicas}
    return {"autoscaling_config": {"min_replicas": ray_config.min_replicas, "max_replicas": ray_config.max_replicas,
                                   "target_ongoing_requests": ray_config.target_ongoing_requests}}


def run_ray(engine_config: EngineConfig, server_config: ServerConfig, ray_config: RayConfig) -> int:
    """Deploy, serve until SIGTERM/SIGINT, delete the application; the exit code."""
    app = build_application(engine_config, server_config, ray_config)
    address = ray_config.ray_address or os.environ.get("RAY_ADDRESS")
    context = ray.init(address=address, namespace=NAMESPACE, logging_level=server_config.log_level.upper(),
                       **({} if address else _local_instance(ray_config)))
    if not address:
        logger.info("%s", _inspect_hint(context.address_info["gcs_address"], context.dashboard_url))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, _interrupt)  # while deploying: stop at once (Ctrl-C too)
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        logger.info("serving on http://%s:%d (Ray Serve, %s)", server_config.host, server_config.port,
                    f"cluster {address}" if address else "a local Ray instance")
        stop.wait()
        logger.info("stopping: in-flight requests have %.1fs to finish", max(0.0, server_config.shutdown_timeout))
        _drain(server_config)
    except KeyboardInterrupt:
        logger.info("interrupted while deploying: deleting the application")
        return 130
    finally:
        _teardown(local=not address)
    return 0


def _local_instance(ray_config: RayConfig) -> dict:
    """ray.init's options for a local instance: its dashboard on loopback where ray[default] is
    installed (Ray starts it only then), none with --ray-dashboard-port 0."""
    if ray_config.ray_dashboard_port == 0:
        return {"include_dashboard": False}
    port = {} if ray_config.ray_dashboard_port is None else {"dashboard_port": ray_config.ray_dashboard_port}
    return {"include_dashboard": None, "dashboard_host": "127.0.0.1", **port}


def _inspect_hint(gcs_address: str, dashboard_url: str | None) -> str:
    """How a Ray user inspects the local instance: Ray's CLI wants its token (written to
    ~/.ray/auth_token by ray.init) and RAY_AUTH_MODE=token."""
    hint = f"local Ray instance at {gcs_address}: `RAY_AUTH_MODE=token ray status --address {gcs_address}`"
    if not dashboard_url:
        return hint + ("; no dashboard: Ray starts one only where ray[default] is installed (pip install 'ray[default]'), "
                       "on a free port (see Ray's log if it did not start); `ray list actors` needs it")
    url = dashboard_url if dashboard_url.startswith("http") else f"http://{dashboard_url}"
    return (hint + f", `RAY_AUTH_MODE=token ray list actors --address {url}`; dashboard at {url} "
            "(its token: `ray get-auth-token`)")


def _drain(server_config: ServerConfig) -> None:
    try:
        serve.get_app_handle(APP_NAME).drain.remote().result(timeout_s=max(0.0, server_config.shutdown_timeout) + 15)
    except Exception as e:  # the ingress is gone already: nothing left to drain
        logger.warning("drain: %s", e)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _teardown(local: bool) -> None:
    try:
        serve.delete(APP_NAME)
        ray.kill(ray.get_actor(board_name(APP_NAME), namespace=NAMESPACE))
    except Exception as e:  # already gone
        logger.debug("teardown: %s", e)
    if local:
        serve.shutdown()
    ray.shutdown()
