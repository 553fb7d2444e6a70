"""specrag on Ray Serve: N replicas of the single-process server behind Ray's HTTP proxy.

    specrag serve --replicas 2                       # a local Ray instance, or RAY_ADDRESS's cluster
    serve run specrag.agent.ray_serve:app_builder replicas=2 model=smollm2-135m

Two deployments. ``SpecragIngress`` (no model; Ray's proxy sends it every HTTP request)
reads the request once and forwards it, with the text its prompt starts with
(``asgi_forward.routing_prompt``), to ``SpecragReplica``. Each replica owns an agent (model,
engine worker, index handle, tools) and answers with the very litestar app of ``specrag
serve`` (``asgi_forward.call_asgi``), so routes, auth, 4xx, 503 back-pressure and SSE behave as
in one process. The replicas' router is Ray's own ``PrefixCacheAffinityRouter`` (Ray Serve
LLM's prefix-aware routing; ``AffinityRouter`` only lets requests with no prompt, the GETs,
go by load): a conversation's next turn, or a user's next run, goes to the replica holding
its prefix blocks and drafting history while the replicas' queues are within
``IMBALANCED_THRESHOLD`` of each other.

Failures: a replica that dies is restarted by Ray; a request that was on it gets a 503
``replica_unavailable`` with ``Retry-After`` (``retryable`` true), and a stream already
under way ends with that error as its last event. Ray's own queue limit is a 503 too.
All replicas read one index directory and follow its rebuilds (``Retriever.refresh``);
finished traces go to a directory they share (``TraceStore(shared_dir=)``), so any replica
answers ``GET /v1/traces/{id}``; ``GET /metrics`` answers with every replica's registry
(``agent/ray_metrics.py``). ``docs/deployment.md`` has the cluster and KubeRay setups.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specrag.agent.asgi_forward import CHAT_PATH, ForwardedRequest, ResponseStart, call_asgi, routing_prompt
from specrag.agent.errors import error_body
from specrag.agent.ray_metrics import MetricsPusher, board, merge_expositions

APP_NAME = "specrag"
REPLICA_HEADER = b"x-specrag-replica"  # which replica answered: for clients' logs and the tests
NODE_HEADER = b"x-specrag-node"  # the Ray node it runs on
# Ray's prefix router keeps a request on the replica holding the longest match of its
# routing text while the replicas' queue lengths differ by at most IMBALANCED_THRESHOLD (then
# it balances load: power of two choices), and only if the match covers MATCH_RATE_THRESHOLD
# of the text; below that it picks the replica holding the least text. Ray's default 0.1
# would pile conversations that merely open alike ("Can you help me ...") onto one replica;
# a conversation's next turn matches far more than half of its text.
IMBALANCED_THRESHOLD = 4
MATCH_RATE_THRESHOLD = 0.5
RETRY_AFTER_S = 1
METRICS_PATH = "/metrics"  # answered with every replica's registry (agent/ray_metrics.py)
# The ingress only reads and forwards (async, no model): it must never be the bottleneck.
# Ray's default of 5 ongoing requests per replica would cap the whole deployment at 5.
INGRESS_MAX_ONGOING = 1024
# Failures of the replica a request was on (it died, or is being restarted), and Ray's queue
# limit: the request never completed, so the client may send it again.
_RETRYABLE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, BackPressureError)


class AffinityRouter(PrefixCacheAffinityRouter):
    """Ray's prefix-aware router; a request without a prompt (``prompt == ""``) goes by load.

    Ray's router divides the matched length by the prompt's, so an empty prompt must not
    reach it: returning None makes it fall back to power of two choices and skip its tree.
    """

    def _extract_text_from_request(self, pending_request: Any) -> str | None:
        text = super()._extract_text_from_request(pending_request)
        return text or None


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica builds its agent from: ``specrag serve``'s options, resolved once."""

    model: str
    index: str | None  # an index directory every replica can read, or None: no retrieval
    draft: str | None = None
    dtype: str = "auto"
    tools: list[str] = field(default_factory=list)  # ``--tools module:attr`` specs
    app: str | None = None  # ``--app module:factory``
    max_in_flight: int = 32
    trace_dir: str | None = None  # shared by the replicas; None: each keeps its own traces
    api_key: str | None = field(default=None, repr=False)  # never in a log line
    calibrate: bool = True  # measure the speculation cost model before taking requests
    engine_url: str | None = None  # generate through this OpenAI-compatible engine (agent/remote.py)
    engine_api_key: str | None = field(default=None, repr=False)

    def namespace(self) -> argparse.Namespace:
        """The fields ``cli_agent.build_agent`` reads, as ``specrag serve`` parses them."""
        return argparse.Namespace(
            model=self.model,
            draft=self.draft,
            dtype=self.dtype,
            tools=list(self.tools),
            app=self.app,
            index=self.index,
            no_index=self.index is None,
            max_in_flight=self.max_in_flight,
            trace_log=None,
            trace_dir=self.trace_dir,
            engine_url=self.engine_url,
            engine_api_key=self.engine_api_key,
        )


class SpecragReplica:
    """One agent and its litestar app; answers forwarded requests (Ray calls ``handle``)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from specrag.agent.cli_agent import build_agent
        from specrag.agent.metrics import ServerMetrics
        from specrag.agent.server import create_app

        replica = ReplicaSpec(**spec)
        self.agent = build_agent(replica.namespace(), concurrent=True, progress=False)
        if replica.calibrate and hasattr(self.agent.engine, "calibrate"):  # not a remote engine
            self.agent.engine.calibrate()
        metrics = ServerMetrics(self.agent)
        self.app = create_app(self.agent, api_key=replica.api_key, metrics=metrics)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id.encode()
        self.node_id = ray.get_runtime_context().get_node_id().encode()
        self.metrics_pusher = MetricsPusher(board(context.app_name), context.replica_id.unique_id, metrics.render)

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for item in call_asgi(self.app, request):
            if isinstance(item, ResponseStart):
                headers = [*item.headers, (REPLICA_HEADER, self.replica_id), (NODE_HEADER, self.node_id)]
                yield ResponseStart(item.status, headers)
            else:
                yield item

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine worker has stopped is replaced."""
        worker = self.agent.worker
        if worker is not None and not worker.alive():
            raise RuntimeError("the engine worker has stopped")

    def __del__(self) -> None:
        pusher = getattr(self, "metrics_pusher", None)
        if pusher is not None:
            pusher.stop()
        agent = getattr(self, "agent", None)
        if agent is not None:
            agent.close()


class SpecragIngress:
    """Ray's proxy sends every request here; it is read once and forwarded to a replica."""

    def __init__(self, replicas: DeploymentHandle, max_body_bytes: int = 1_000_000) -> None:
        self.replicas = replicas.options(stream=True)
        self.max_body_bytes = max_body_bytes
        self.metrics_board = board(serve.get_replica_context().app_name)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        if len(body) > self.max_body_bytes:  # as litestar's request_max_body_size answers
            return _error(413, "request_too_large", f"the body is over {self.max_body_bytes} bytes", "body")
        path = request.scope["path"]
        forwarded = ForwardedRequest(
            method=request.method,
            path=path,
            query_string=request.scope.get("query_string", b""),
            headers=[(bytes(k), bytes(v)) for k, v in request.scope["headers"]],
            body=body,
            prompt=routing_prompt(request.method, path, body),
        )
        stream: DeploymentResponseGenerator = self.replicas.handle.remote(forwarded)
        try:
            start = await stream.__anext__()
        except _RETRYABLE as error:
            return _retryable(error)
        if start.status == 200 and request.method == "GET" and path.rstrip("/") == METRICS_PATH:
            return await self._every_replicas_metrics(stream, start)
        events = _is_event_stream(start.headers)
        response = StreamingResponse(_rest(stream, path if events else None), status_code=start.status)
        response.raw_headers = list(start.headers)
        return response

    async def _every_replicas_metrics(self, stream: DeploymentResponseGenerator, start: ResponseStart) -> Response:
        """The replica that took the scrape accepted its key; the answer is every replica's."""
        async for _ in stream:  # its own registry: on the board too, at most a push old
            pass
        merged = merge_expositions(await self.metrics_board.fresh.remote())
        content_type = next((v.decode() for k, v in start.headers if k.lower() == b"content-type"), None)
        return Response(merged, status_code=200, media_type=content_type)


async def _rest(stream: DeploymentResponseGenerator, event_path: str | None) -> AsyncIterator[bytes]:
    """The body's chunks. An SSE stream whose replica dies ends with the error in the shape
    that route's own failures take: a chat's ``data: {"error": ...}`` and ``[DONE]`` (as
    OpenAI sends one), an agent run's ``error`` event. Any other body is cut, as a dropped
    connection would be: its length was announced, so the client sees it incomplete."""
    try:
        async for chunk in stream:
            yield chunk
    except _RETRYABLE as error:
        if event_path is None:
            raise
        error_data = _retryable_body(error)
        if event_path.rstrip("/") == CHAT_PATH:
            yield f"data: {json.dumps(error_data)}\n\ndata: [DONE]\n\n".encode()
        else:
            yield f"event: error\ndata: {json.dumps(error_data['error'])}\n\n".encode()


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


def _retryable_body(error: BaseException) -> dict[str, Any]:
    if isinstance(error, BackPressureError):
        kind, message = "overloaded_error", "every replica's queue is full; retry later"
    else:
        kind, message = "replica_unavailable", "the replica serving this request stopped before answering; retry it"
    body: dict[str, Any] = error_body(kind, message)
    body["error"]["retryable"] = True
    return body


def _retryable(error: BaseException) -> Response:
    return JSONResponse(_retryable_body(error), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def _error(status: int, kind: str, message: str, field_name: str) -> Response:
    return JSONResponse(error_body(kind, message, field_name), status_code=status)


@dataclass(frozen=True)
class Scaling:
    """Replicas: a fixed number, or Ray Serve's autoscaling between min and max."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0
    replica_cpus: float = 1.0
    max_queued_requests: int = 64  # per caller; beyond it Ray refuses (a 503 here)
    prefix_routing: bool = True  # False: Ray's default router (power of two choices), for comparison

    def options(self, max_in_flight: int) -> dict[str, Any]:
        ray_options: dict[str, Any] = {
            "max_ongoing_requests": max_in_flight,
            "max_queued_requests": self.max_queued_requests,
            "ray_actor_options": {"num_cpus": self.replica_cpus},
        }
        if self.prefix_routing:
            ray_options["request_router_config"] = RequestRouterConfig(
                request_router_class=AffinityRouter,
                request_router_kwargs={
                    "imbalanced_threshold": IMBALANCED_THRESHOLD,
                    "match_rate_threshold": MATCH_RATE_THRESHOLD,
                },
            )
        if self.max_replicas is None:
            return ray_options | {"num_replicas": self.replicas}
        autoscaling = AutoscalingConfig(
            min_replicas=self.min_replicas if self.min_replicas is not None else 1,
            initial_replicas=self.replicas,
            max_replicas=self.max_replicas,
            target_ongoing_requests=self.target_ongoing_requests,
        )
        return ray_options | {"autoscaling_config": autoscaling}


def application(spec: ReplicaSpec, scaling: Scaling = Scaling(), max_body_bytes: int = 1_000_000) -> Any:
    """The Ray Serve application: an ingress over ``scaling``'s replicas of ``spec``."""
    replica = serve.deployment(SpecragReplica, name="SpecragReplica", **scaling.options(spec.max_in_flight))
    ingress = serve.deployment(
        SpecragIngress,
        name="SpecragIngress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING,
    )
    return ingress.bind(replica.bind(asdict(spec)), max_body_bytes)


def app_builder(args: dict[str, str]) -> Any:
    """For ``serve run specrag.agent.ray_serve:app_builder key=value ...`` and Serve config
    files: the keys are ``specrag serve``'s options without dashes (``replicas=2 model=...``)."""
    from specrag.agent.cli_agent import serve_parser

    parsed = serve_parser().parse_args(builder_argv(args))
    return application(replica_spec(parsed), scaling_of(parsed))


def builder_argv(args: dict[str, Any]) -> list[str]:
    """``key=value`` arguments as ``specrag serve`` options; a flag is ``key=true`` (or false)."""
    argv = []
    for key, value in args.items():
        option = f"--{key.replace('_', '-')}"
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            argv += [option] if str(value).lower() == "true" else []
        else:
            argv.append(f"{option}={value}")
    return argv


def replica_spec(args: argparse.Namespace) -> ReplicaSpec:
    """``specrag serve``'s parsed options as a replica builds them (the sample index resolved)."""
    from specrag.agent.cli_agent import engine_index_problem
    from specrag.agent.sample_index import ensure_sample_index

    problem = engine_index_problem(args)
    if problem is not None:
        raise ValueError(problem)
    index = None if args.no_index else args.index or str(ensure_sample_index(args.model, progress=True))
    trace_dir = args.trace_dir or str(Path("~/.cache/specrag/traces/ray").expanduser())
    return ReplicaSpec(
        model=args.model,
        index=str(Path(index).expanduser().resolve()) if index else None,
        draft=args.draft,
        dtype=args.dtype,
        tools=list(args.tools or []),
        app=args.app,
        max_in_flight=args.max_in_flight,
        trace_dir=trace_dir,
        api_key=os.environ.get("SPECRAG_API_KEY") or None,
        engine_url=args.engine_url,
        engine_api_key=os.environ.get("SPECRAG_ENGINE_API_KEY") or None,
    )


def scaling_of(args: argparse.Namespace) -> Scaling:
    return Scaling(
        replicas=args.replicas or 1,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        replica_cpus=args.replica_cpus,
    )


def run(args: argparse.Namespace) -> int:
    """``specrag serve --replicas N``: start (or join) Ray, deploy, and block until interrupted."""
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS"), namespace=APP_NAME)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(
        application(replica_spec(args), scaling_of(args)),
        name=APP_NAME,
        route_prefix="/",
        blocking=True,
    )
    return 0
