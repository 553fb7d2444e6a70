"""specrag on a real local Ray cluster of two nodes: a smollm2 replica on each, behind Ray
Serve's HTTP proxy on the head node.

The official ``openai`` client and the agent endpoint through the proxy; errors, auth and
health as in one process; a conversation kept on one replica by Ray's prefix-aware router;
traces answered by any replica; an index rebuild picked up by both replicas without a
failed request; one replica killed under load, with every request's outcome counted.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.cluster_utils import Cluster

from specrag.agent.cli_agent import serve_parser
from specrag.agent.ray_serve import APP_NAME, ReplicaSpec, Scaling, application, builder_argv, scaling_of
from specrag.evals.bench.ray_routing import free_port
from specrag.retrieval import Corpus, Document, build_index
from tests.retrieval_helpers import chunker, sample_index, sample_subset, shared_embedder
from tests.server_helpers import assert_error, wait_until

pytestmark = pytest.mark.slow

KEY = "ray-test-key"
WORDS = ("apple", "river", "cloud", "stone", "maple", "harbor")
MODEL = "smollm2-135m"
REPLICA = "x-specrag-replica"
NODE = "x-specrag-node"
IN_FLIGHT = 8  # per replica (max_in_flight, Ray's max_ongoing_requests)
# Waiting at the ingress for a replica beyond those; then 503. Ray counts a request as queued
# until its router has placed it, so a burst larger than this is refused even with free
# replicas: the kill test's burst stays below it.
QUEUED = 8


@pytest.fixture(scope="module")
def index_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the sample subset's index that the rebuild test may publish a version into."""
    built, _ = sample_index(tmp_path_factory.getbasetemp())
    root = tmp_path_factory.mktemp("ray") / "index"
    shutil.copytree(built, root)
    return root


@pytest.fixture(scope="module")
def url(index_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # A Ray cluster of two nodes on this machine (Ray's own test utility: a head and a worker
    # raylet), one CPU each, so each replica is placed on its own node; the proxy on the head.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, namespace="specrag-tests", log_to_driver=False)
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    spec = ReplicaSpec(
        model=MODEL,
        index=str(index_root),
        dtype="float32",
        max_in_flight=IN_FLIGHT,
        trace_dir=str(tmp_path_factory.mktemp("traces")),
        api_key=KEY,
        calibrate=False,
    )
    scaling = Scaling(replicas=2, max_queued_requests=QUEUED)
    serve.run(application(spec, scaling), name=APP_NAME, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def test_autoscaling_and_routing_settings_reach_ray() -> None:
    options = Scaling(replicas=2, min_replicas=1, max_replicas=4, target_ongoing_requests=3).options(max_in_flight=8)
    autoscaling = options["autoscaling_config"]
    assert (autoscaling.min_replicas, autoscaling.initial_replicas, autoscaling.max_replicas) == (1, 2, 4)
    assert autoscaling.target_ongoing_requests == 3 and "num_replicas" not in options
    assert options["max_ongoing_requests"] == 8  # Ray queues beyond the replica's own limit
    assert options["request_router_config"].request_router_kwargs["match_rate_threshold"] == 0.5
    fixed = Scaling(replicas=3, prefix_routing=False).options(max_in_flight=8)
    assert fixed["num_replicas"] == 3 and "request_router_config" not in fixed and "autoscaling_config" not in fixed


def test_serve_run_arguments_are_specrag_serve_options() -> None:
    argv = builder_argv({"replicas": 2, "max_replicas": "5", "no_index": "true", "model": MODEL})
    assert argv == ["--replicas=2", "--max-replicas=5", "--no-index", f"--model={MODEL}"]
    parsed = serve_parser().parse_args(argv)
    assert parsed.no_index and scaling_of(parsed).max_replicas == 5


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def chat(url: str, messages: list[dict[str, str]], **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth(), timeout=120)


def test_the_openai_client_through_the_proxy(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    messages: Any = [{"role": "user", "content": "Name a colour."}]
    completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert completion.choices[0].message.content and completion.usage is not None
    assert completion.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == completion.choices[0].message.content  # greedy, on whichever replica
    assert [model.id for model in client.models.list()] == [MODEL]


def test_the_agent_endpoint_json_and_sse(url: str) -> None:
    body = {"question": "What does the with statement do?", "max_tokens": 12, "stream": False}
    response = httpx.post(f"{url}/v1/agent/runs", json=body, headers=auth(), timeout=120)
    assert response.status_code == 200, response.text
    run = response.json()
    assert run["answer"] and run["passages"] and response.headers[REPLICA]
    events = []
    with httpx.stream("POST", f"{url}/v1/agent/runs", json=body | {"stream": True}, headers=auth(), timeout=120) as sse:
        assert sse.headers["content-type"].startswith("text/event-stream")
        events = [line[len("event: ") :] for line in sse.iter_lines() if line.startswith("event: ")]
    assert events[-1] == "final" and "token" in events
    trace_ids = {run["trace_id"]}
    for _ in range(6):  # any replica answers for any trace (the shared trace directory)
        trace = httpx.get(f"{url}/v1/traces/{run['trace_id']}", headers=auth(), timeout=30)
        assert trace.status_code == 200 and trace.json()["trace_id"] in trace_ids


def test_errors_auth_and_health_as_in_one_process(url: str) -> None:
    assert_error(chat(url, [{"role": "user", "content": "hi"}], max_tokens=-1), 400, "max_tokens")
    response = httpx.post(f"{url}/v1/agent/runs", json={"question": ""}, headers=auth(), timeout=30)
    assert_error(response, 400, "question")
    missing = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert_error(missing, 401)
    health = httpx.get(f"{url}/healthz", timeout=30)  # no key needed
    assert health.status_code == 200 and health.json()["model"] == MODEL
    assert httpx.get(f"{url}/metrics", headers=auth(), timeout=30).status_code == 200


def chats_answered(url: str) -> dict[str, float]:
    """Per replica, chat completions answered 200, from ``GET /metrics`` through the proxy."""
    text = httpx.get(f"{url}/metrics", headers=auth(), timeout=30).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            chat_route = labels.get("route") == "/v1/chat/completions" and labels.get("status") == "200"
            if sample.name == "specrag:http_requests_total" and chat_route:
                counts[labels["replica"]] = counts.get(labels["replica"], 0) + sample.value
    return counts


def test_metrics_through_the_proxy_cover_every_replica(url: str) -> None:
    """A scrape lands on one replica but answers for both, each series labelled ``replica``;
    chats answered by either show up in it (each replica pushes its registry every second)."""
    assert wait_until(lambda: len(set(replica_series(url))) == 2, timeout=30, interval=0.5)
    before = sum(chats_answered(url).values())
    replicas = {chat(url, [{"role": "user", "content": f"Say {word}."}]).headers[REPLICA] for word in WORDS}
    assert wait_until(lambda: sum(chats_answered(url).values()) >= before + len(WORDS), timeout=30, interval=0.5)
    assert replicas <= set(replica_series(url))
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 401  # the key, as in one process


def replica_series(url: str) -> list[str]:
    text = httpx.get(f"{url}/metrics", headers=auth(), timeout=30).text
    families = text_string_to_metric_families(text)
    return [sample.labels["replica"] for family in families for sample in family.samples]


def test_a_conversation_stays_on_its_replica(url: str) -> None:
    """Ray's prefix-aware router: each later turn extends the earlier ones' text, so it goes
    where their cached blocks are; a conversation sharing no prefix with any earlier one goes
    to the replica holding the least text."""
    homes, nodes = [], {}
    for topic in ("Rivers", "Tea", "Chess", "Opera"):  # no two share a first letter
        messages = [{"role": "user", "content": f"{topic}: tell me one fact, in detail please."}]
        replicas = set()
        for turn in range(3):
            response = chat(url, messages)
            assert response.status_code == 200, response.text
            replicas.add(response.headers[REPLICA])
            nodes[response.headers[REPLICA]] = response.headers[NODE]
            answer = response.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And {turn}?"}]
        assert len(replicas) == 1, (topic, replicas)
        homes.append(replicas.pop())
    assert len(set(homes)) == 2, homes  # both replicas took conversations
    assert len(set(nodes.values())) == 2, nodes  # one replica on each node of the cluster


def replicas_seen_at(url: str, version: str) -> set[str]:
    """The replicas whose /healthz reports ``version`` (health checks go by load, so a few
    calls reach both)."""
    seen = set()
    for _ in range(12):
        response = httpx.get(f"{url}/healthz", timeout=30)
        assert response.status_code == 200, response.text
        if response.json()["index"]["version"] == version:
            seen.add(response.headers[REPLICA])
    return seen


def test_an_index_rebuild_reaches_both_replicas_without_a_failed_request(url: str, index_root: Path) -> None:
    documents = [
        *sample_subset().documents,
        Document.from_text("notes/ray.md", "# Quokkas\n\nQuokkas live on Rottnest."),
    ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        questions = [f"Where do quokkas live? ({n})" for n in range(4)]
        body = {"max_tokens": 4, "stream": False}
        runs = [
            pool.submit(httpx.post, f"{url}/v1/agent/runs", json=body | {"question": q}, headers=auth(), timeout=120)
            for q in questions
        ]
        report = build_index(index_root, Corpus(documents), shared_embedder(), chunker())
        assert report.written and report.version == "00000002"
        statuses = [run.result().status_code for run in runs]
    assert statuses == [200] * 4  # the switch failed no request in flight
    assert wait_until(lambda: len(replicas_seen_at(url, "00000002")) == 2, timeout=60, interval=1)
    response = httpx.post(
        f"{url}/v1/agent/runs", json=body | {"question": "Where do quokkas live?"}, headers=auth(), timeout=120
    )
    assert "notes/ray.md" in {passage["source"] for passage in response.json()["passages"]}


def test_beyond_every_replicas_limit_and_rays_queue_a_retryable_503(url: str) -> None:
    """Two replicas take IN_FLIGHT requests each and Ray queues about QUEUED more; the rest
    are refused at once with the retryable 503, and every request is one or the other.

    Ray's queue count is not an exact bound (seen here: 31 of 34 taken beside a nominal 24,
    none finished yet), so the burst is twice the nominal capacity and the test asserts that
    some are refused (without the queue limit none is) and that no request fails otherwise."""
    sent = 2 * (2 * IN_FLIGHT + QUEUED)
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "speculation": "off"}

    def post(n: int) -> httpx.Response:
        messages = [{"role": "user", "content": f"Write a long story about lighthouse number {n}."}]
        return httpx.post(f"{url}/v1/chat/completions", json=body | {"messages": messages}, headers=auth(), timeout=300)

    with concurrent.futures.ThreadPoolExecutor(sent) as pool:
        responses = list(pool.map(post, range(sent)))
    statuses = [response.status_code for response in responses]
    assert set(statuses) == {200, 503}, statuses
    for response in responses:
        if response.status_code == 503:
            error = assert_error(response, 503)
            assert error["type"] == "overloaded_error" and error["retryable"] and response.headers["retry-after"] == "1"


def stream_outcome(url: str, text: str, started: list[str]) -> tuple[str | None, str]:
    """One streamed chat: (the replica it started on, if it did; "ok" if it finished,
    "retryable" if it failed with the retryable error, before or during the stream).
    Anything else is returned as it came, to be seen in the assertion."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    body |= {"max_tokens": 48, "temperature": 0, "stream": True, "speculation": "off"}
    replica = None
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth(), timeout=180) as response:
            if response.status_code == 503:
                error = json.loads(response.read())["error"]
                return None, "retryable" if error["retryable"] and response.headers["retry-after"] else str(error)
            if response.status_code != 200:
                return None, f"status {response.status_code}"
            replica = response.headers[REPLICA]
            started.append(replica)
            lines = [line for line in response.iter_lines() if line]
    except httpx.HTTPError as error:
        return replica, f"transport: {error!r}"
    if lines[-1:] != ["data: [DONE]"]:
        return replica, f"cut: {lines[-2:]}"
    last = json.loads(lines[-2][len("data: ") :])
    if "error" in last:  # the replica died mid-stream: the error, as a chat stream reports one
        return replica, "retryable" if last["error"]["retryable"] else str(last)
    return replica, "ok"


def replica_actor(unique_id: str) -> Any:
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)]
    (name,) = [name for name in names if name.endswith(f"#{unique_id}") and "SpecragReplica" in name]
    return ray.get_actor(name, namespace="serve")


def running_replicas() -> int:
    status = serve.status().applications[APP_NAME].deployments["SpecragReplica"]
    return int(status.replica_states.get("RUNNING", 0))


def one_opening_per_replica(url: str) -> dict[str, str]:
    """A long opening whose conversation each replica holds. New openings go to the replica
    holding the least routed text, so a few distinct ones reach both."""
    homes: dict[str, str] = {}
    for word in ("Quince", "Walnut", "Yarrow", "Zinnia", "Umber", "Violet", "Xenon", "Kestrel"):
        opening = f"{word} " * 60  # long: it dominates the routing text of what extends it
        response = chat(url, [{"role": "user", "content": opening}], max_tokens=1)
        assert response.status_code == 200, response.text
        homes.setdefault(response.headers[REPLICA], opening)
        if len(homes) == 2:
            return homes
    raise AssertionError(f"new conversations reached one replica only: {homes}")


def test_a_replica_killed_under_load_loses_no_request_silently(url: str) -> None:
    """Three streams extend a conversation on each replica (so the prefix router keeps them
    there); one replica is killed while they run. Its requests fail with the retryable
    error, the other's finish, and Ray restarts it."""
    homes = one_opening_per_replica(url)
    victim, survivor = list(homes)
    texts = [homes[replica] + f"Now count to fifty slowly ({n})." for replica in (victim, survivor) for n in range(3)]
    started: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        outcomes = [pool.submit(stream_outcome, url, text, started) for text in texts]
        assert wait_until(lambda: started.count(victim) >= 1 and len(started) >= 4, timeout=120, interval=0.05)
        ray.kill(replica_actor(victim), no_restart=False)
        results = [outcome.result() for outcome in outcomes]
    assert len(results) == len(texts)
    assert {outcome for _, outcome in results} <= {"ok", "retryable"}, results  # none lost silently
    assert [outcome for _, outcome in results[3:]] == ["ok"] * 3, results  # the survivor's all finished
    assert {replica for replica, _ in results[3:]} == {survivor}, results
    assert any(outcome == "retryable" for replica, outcome in results[:3] if replica == victim), results
    assert wait_until(lambda: running_replicas() == 2, timeout=180, interval=1)  # Ray restarted it
    response = chat(url, [{"role": "user", "content": "Still there?"}])
    assert response.status_code == 200, response.text
