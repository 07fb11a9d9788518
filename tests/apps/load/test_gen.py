"""The load generator's figures (hand-computed), its classification of answers against a fake
endpoint, and the read back of acknowledged interactions (in-memory stream backend)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx
import pytest

from apps.load.gen import LoadGenerator
from apps.load.report import result_json, write_results
from apps.load.readback import acked_interactions, check_logged, stamped_since, topic_ends
from apps.load.stats import LoadParams, RequestRecord, VersionPoint, percentile, summarize, versions_text
from online_sao.schemas import Interaction, encode
from streams.memory import InMemoryBackend


def test_percentile_is_linear_between_the_closest_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5  # rank 1.5 of [1, 2, 3, 4]
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def _records() -> list[RequestRecord]:
    return [
        RequestRecord("chat", 0, 0.0, 1.0, 200, None, "a", (0,), 10),
        RequestRecord("stream", 1, 0.5, 2.0, 200, None, "b", (0, 1), 20, ttft_s=0.5),
        RequestRecord("chat", 0, 1.0, 3.0, 200, None, "c", (1,), 6),
        RequestRecord("chat", 2, 2.0, 0.1, 503, "503"),
        RequestRecord("stream", 1, 3.0, 0.4, 200, "stream:server_error", "d"),
        RequestRecord("chat", 2, 4.0, 0.1, 429, "429"),
        RequestRecord("feedback", 0, 1.0, 0.2, 200, None, "a"),
        RequestRecord("feedback", 1, 2.5, 0.2, 422, "422", "b"),
    ]


def test_summary_of_hand_made_records():
    versions = [VersionPoint(0.0, 0), VersionPoint(1.2, 1), VersionPoint(5.0, 2)]
    s = summarize(_records(), wall_s=10.0, versions=versions)
    assert (s.requests, s.answered) == (6, 3)
    assert s.throughput_rps == pytest.approx(0.3)  # 3 answered / 10 s
    assert s.tokens_per_s == pytest.approx(3.6)  # (10 + 20 + 6) / 10 s
    assert s.latency_p50_s == 2.0  # of [1, 2, 3]
    assert s.latency_p99_s == pytest.approx(2.98)  # rank 1.98
    assert s.latency_max_s == 3.0
    assert s.ttft_p50_s == 0.5
    assert s.errors == {"422": 1, "429": 1, "503": 1, "stream:server_error": 1}
    assert s.server_errors == 2  # the 503 and the server error inside a stream
    assert (s.feedback_sent, s.feedback_ok) == (2, 1)
    assert s.versions_seen == [0, 1]
    assert s.version_first_seen_s == {0: 1.0, 1: 2.5}  # ends of the first answers carrying them
    assert s.answers_across_swap == 1
    assert s.swaps_observed == 2
    assert versions_text(s.versions_seen) == "[0, 1]"
    assert versions_text(list(range(41))) == "v0..v40 (41)"


def test_which_failures_count_as_server_errors():
    def rec(status: int, error: str | None) -> RequestRecord:
        return RequestRecord("stream", 0, 0.0, 1.0, status, error)

    assert rec(500, "500").server_error and rec(503, "503").server_error
    assert rec(200, "stream:service_unavailable").server_error
    assert rec(504, "504").server_error and rec(200, "stream:timeout_error").server_error  # serving's deadline
    assert not rec(429, "429").server_error
    assert not rec(200, "stream:invalid_request_error").server_error
    assert not rec(0, "timeout").server_error and not rec(200, None).server_error


def test_acknowledged_are_answered_chats_with_an_id():
    assert acked_interactions(_records()) == {"a": (0,), "b": (0, 1), "c": (1,)}


def _interaction(iid: str, versions: list[int]) -> Interaction:
    n = len(versions)
    return Interaction(interaction_id=iid, model="m", prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)),
                       action_mask=[True] * n, logprobs=[-0.5] * n, versions=versions)


def test_check_logged_finds_missing_duplicated_and_mismatched_ids():
    backend = InMemoryBackend()
    backend.create_topic("interactions", 3)
    producer = backend.producer()
    for record in (_interaction("a", [0, 0]), _interaction("b", [0]), _interaction("b", [0]),
                   _interaction("c", [0, 1]), _interaction("x", [2])):
        producer.send("interactions", encode(record), key=record.interaction_id.encode())
    producer.send("interactions", b"not json", key=b"a")  # crashed the read back after the whole run
    acked = {"a": (0,), "b": (0,), "c": (1,), "d": (0,)}

    check = check_logged(backend, "interactions", acked, timeout_s=1.0, quiet_s=0.0)

    assert (check.acked, check.found, check.records_read, check.unreadable) == (4, 3, 5, 1)
    assert check.missing == ["d"]
    assert check.duplicates == {"b": 2}
    assert check.version_mismatches == ["c"]  # logged (0, 1), answered (1,)
    assert check.unacked_logged == 1
    assert not check.ok
    complete = check_logged(backend, "interactions", {"a": (0,), "b": (0,)}, timeout_s=5.0, quiet_s=0.0)
    assert complete.ok and complete.missing == [] and complete.duplicates == {"b": 2}


def test_a_load_against_a_deployment_reads_back_from_where_the_topic_ended_before_it():
    """``load --url`` read the deployment's interactions topic from its start: all the earlier traffic
    counted as logged but not acknowledged, and a topic holding more than the read back's time limit
    ran the clock out before the run's records at its end, every one reported missing."""
    backend = InMemoryBackend()
    backend.create_topic("interactions", 2)
    producer = backend.producer()
    for k in range(500):  # the deployment's earlier traffic
        producer.send("interactions", encode(_interaction(f"old{k}", [0])), key=f"old{k}".encode())
    since = topic_ends(backend, "interactions")
    assert sum(since.values()) == 500
    for iid in ("a", "b"):  # the load's
        producer.send("interactions", encode(_interaction(iid, [1])), key=iid.encode())

    check = check_logged(backend, "interactions", {"a": (1,), "b": (1,)}, timeout_s=5.0, quiet_s=0.0, since=since)
    assert check.ok and check.found == 2 and check.records_read == 2 and check.unacked_logged == 0
    from_start = check_logged(backend, "interactions", {"a": (1,), "b": (1,)}, timeout_s=5.0, quiet_s=0.0)
    assert from_start.unacked_logged > 0  # the earlier traffic, counted as the run's when read from the start


def test_without_where_the_topic_ended_the_read_back_starts_at_the_records_stamped_since_the_load(monkeypatch):
    """Where the topic ended before the load could not be read (the broker briefly away): the read back
    started at the topic's start, with the same two failures as without the mark."""
    import streams.memory

    backend = InMemoryBackend()
    backend.create_topic("interactions", 2)
    producer = backend.producer()
    monkeypatch.setattr(streams.memory.time, "time", lambda: 1_000_000.0)  # the deployment's earlier traffic
    for k in range(300):
        producer.send("interactions", encode(_interaction(f"old{k}", [0])), key=f"old{k}".encode())
    monkeypatch.undo()
    began = time.time()
    for iid in ("a", "b"):
        producer.send("interactions", encode(_interaction(iid, [1])), key=iid.encode())

    since = stamped_since(backend, "interactions", began - 60.0)
    check = check_logged(backend, "interactions", {"a": (1,), "b": (1,)}, timeout_s=5.0, quiet_s=0.0, since=since)
    assert check.ok and check.records_read == 2 and check.unacked_logged == 0


class FakeEndpoint:
    """Answers like serving: every 5th chat 503, every 4th stream an error event after its first
    chunk, every 6th stream cut without a final chunk; the version rises every 10 answers."""

    def __init__(self) -> None:
        self.count = itertools.count()
        self.sent = {"503": 0, "stream_error": 0, "cut": 0, "ok": 0}
        self.answered: set[str] = set()
        self.feedback: list[str] = []
        self.version = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "online-sao", "policy_version": self.version}]})
        if request.url.path == "/v1/feedback":
            self.feedback.append(json.loads(request.content)["interaction_id"])
            return httpx.Response(200, json={"status": "accepted"})
        body = json.loads(request.content)
        n = next(self.count)
        iid = f"sao-{n}"
        if not body.get("stream"):
            if n % 5 == 0:
                self.sent["503"] += 1
                return httpx.Response(503, json={"error": {"message": "no", "type": "service_unavailable",
                                                           "param": None, "code": "logging_unavailable"}})
            self._answered(iid)
            return httpx.Response(200, json={
                "id": iid, "object": "chat.completion", "created": 0, "model": "online-sao",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                "interaction_id": iid, "policy_version": self.version, "policy_versions": [self.version]})
        events = [self._chunk(iid, {"role": "assistant", "content": ""}), self._chunk(iid, {"content": "hi"})]
        if n % 4 == 0:
            self.sent["stream_error"] += 1
            events.append({"error": {"message": "boom", "type": "server_error", "param": None, "code": None}})
        elif n % 6 == 0:
            self.sent["cut"] += 1
        else:
            self._answered(iid)
            events.append(self._chunk(iid, {}, finish="length", versions=[self.version]))
            events.append({"id": iid, "object": "chat.completion.chunk", "created": 0, "model": "online-sao",
                           "choices": [], "interaction_id": iid,
                           "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
        if n % 4 and n % 6:
            text += "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})

    def _answered(self, iid: str) -> None:
        self.sent["ok"] += 1
        self.answered.add(iid)
        if self.sent["ok"] % 10 == 0:
            self.version += 1

    @staticmethod
    def _chunk(iid: str, delta: dict, finish: str | None = None, versions: list[int] | None = None) -> dict:
        return {"id": iid, "object": "chat.completion.chunk", "created": 0, "model": "online-sao",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "interaction_id": iid,
                "policy_version": max(versions) if versions else None, "policy_versions": versions}


def test_generator_classifies_every_answer_of_a_fake_endpoint(tmp_path):
    fake = FakeEndpoint()
    params = LoadParams(clients=3, duration_s=120.0, requests_per_client=40, stream_share=0.5, feedback_share=0.5,
                        version_poll_s=0.05, progress_every_s=0.2, failure_pause_s=0.0)
    lines: list[str] = []
    gen = LoadGenerator("http://fake", None, params, progress=lines.append, prompts=["p1", "p2"],
                        transport=httpx.MockTransport(fake))
    result = asyncio.run(gen.run())
    s = summarize(result.records, result.wall_s, result.versions)

    assert s.requests == next(fake.count) == 3 * 40  # every request the endpoint saw was recorded
    assert s.answered == fake.sent["ok"] > 0
    assert s.errors.get("503", 0) == fake.sent["503"] > 0
    assert s.errors.get("stream:server_error", 0) == fake.sent["stream_error"] > 0
    assert s.errors.get("incomplete", 0) == fake.sent["cut"]
    assert s.server_errors == fake.sent["503"] + fake.sent["stream_error"]
    assert set(acked_interactions(result.records)) == fake.answered
    assert s.feedback_sent == len(fake.feedback) and set(fake.feedback) <= fake.answered
    streams = [r for r in result.records if r.kind == "stream" and r.ok]
    assert streams and all(r.completion_tokens == 4 and r.ttft_s is not None for r in streams)
    assert s.versions_seen == list(range(fake.version + 1)) or s.versions_seen == list(range(fake.version))
    assert [p.version for p in result.versions] == sorted({p.version for p in result.versions})
    assert lines and lines[-1].startswith("[load done")

    json_path, png = write_results(tmp_path / "load.json", result, s, {"command": "test"})
    saved = json.loads(json_path.read_text())
    assert saved["summary"]["answered"] == s.answered and len(saved["requests"]) == len(result.records)
    assert png.stat().st_size > 0
    assert "requests" not in result_json(result, s, include_requests=False)


def test_a_kafka_check_that_cannot_run_still_writes_the_results_and_fails_the_run(tmp_path, monkeypatch, capsys):
    """`load --url` with the broker down: the load ran, its results are worth keeping."""
    from apps import cli
    from streams.base import StreamUnavailable

    fake = FakeEndpoint()
    params = LoadParams(clients=2, duration_s=60.0, requests_per_client=6, stream_share=0.0, feedback_share=0.0,
                        version_poll_s=0.05, progress_every_s=0.2, failure_pause_s=0.0)
    ran = asyncio.run(LoadGenerator("http://fake", None, params, progress=lambda line: None, prompts=["p"],
                                    transport=httpx.MockTransport(fake)).run())

    def unreachable(*args, **kwargs):
        raise StreamUnavailable("Kafka at 127.0.0.1:1 not reachable")

    monkeypatch.setattr("apps.load.gen.run_load", lambda *args, **kwargs: ran)
    monkeypatch.setattr("apps.load.run.topic_ends", unreachable)  # where the read back would start
    monkeypatch.setattr("apps.load.run.stamped_since", unreachable)  # its stand-in after the load
    monkeypatch.setattr("apps.load.run.check_logged", unreachable)
    out = tmp_path / "load.json"
    assert cli.main(["load", "--url", "http://fake", "--out", str(out)]) == 1
    saved = json.loads(out.read_text())
    assert saved["summary"]["answered"] > 0 and "Kafka at 127.0.0.1:1 not reachable" in saved["kafka_check"]
    assert "kafka: the Kafka check could not run" in capsys.readouterr().out


def _chat_answer(iid: str) -> dict:
    return {"id": iid, "object": "chat.completion", "created": 0, "model": "online-sao",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            "interaction_id": iid, "policy_version": 0, "policy_versions": [0]}


def _run(params: LoadParams, handler, **kwargs):
    gen = LoadGenerator("http://fake", None, params, progress=lambda line: None, prompts=["p"],
                        transport=httpx.MockTransport(handler), **kwargs)
    return asyncio.run(gen.run())


def _quick_params(**changes) -> LoadParams:
    return LoadParams(**{"clients": 2, "duration_s": 0.3, "stream_share": 0.0, "feedback_share": 0.0,
                         "version_poll_s": 0.05, "progress_every_s": 100.0, "failure_pause_s": 0.0, **changes})


def test_wall_time_ends_with_the_clients_not_with_a_version_poll_still_in_flight():
    """A busy server answers /v1/models slowly: the run waited for that poll (up to POLL_TIMEOUT_S)
    and counted the wait in wall_s, lowering the reported throughput."""
    poll_s = 2.0

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            await asyncio.sleep(poll_s)
            return httpx.Response(200, json={"data": [{"id": "online-sao", "policy_version": 0}]})
        return httpx.Response(200, json=_chat_answer(f"sao-{id(request)}"))

    result = _run(_quick_params(), handler)
    last_answer_s = max(r.end_s for r in result.records)
    assert result.wall_s < poll_s and result.wall_s - last_answer_s < 0.5, (result.wall_s, last_answer_s)


@pytest.mark.parametrize("body", [
    b"[]", b'{"data": null}', b'{"data": [{"id": "online-sao", "policy_version": null}]}',
    b'{"data": ["online-sao"]}', b'{"data": [{"id": "online-sao", "policy_version": Infinity}]}',
], ids=["list", "null-data", "null-version", "string-entry", "infinite-version"])
def test_a_malformed_models_answer_is_a_poll_error_not_the_end_of_the_run(body):
    """The TypeError (and OverflowError) of such a body ended the watcher and, at the run's end, the
    whole run: no results."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, content=body, headers={"content-type": "application/json"})
        return httpx.Response(200, json=_chat_answer("sao-1"))

    result = _run(_quick_params(), handler)
    assert result.version_poll_errors > 0 and result.versions == [] and result.records


class _TricklingStream(httpx.AsyncByteStream):
    """A stream that sends a content chunk every ``every_s``, ``chunks`` times, then its end: each read
    is quick, the whole answer slow."""

    def __init__(self, chunks: int, every_s: float) -> None:
        self.chunks, self.every_s = chunks, every_s

    async def __aiter__(self):
        for _ in range(self.chunks):
            await asyncio.sleep(self.every_s)
            yield f"data: {json.dumps(FakeEndpoint._chunk('sao-1', {'content': 'x'}))}\n\n".encode()
        yield f"data: {json.dumps(FakeEndpoint._chunk('sao-1', {}, 'stop', [0]))}\n\ndata: [DONE]\n\n".encode()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_a_request_slower_than_request_timeout_s_counts_as_a_timeout(stream):
    """The client's timeout bounds each read, so a stream that trickles (or any request the transport
    does not time) ran on past request_timeout_s and was counted as answered."""
    timeout_s = 0.4

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "online-sao", "policy_version": 0}]})
        if stream:
            return httpx.Response(200, stream=_TricklingStream(chunks=20, every_s=0.05),
                                  headers={"content-type": "text/event-stream"})
        await asyncio.sleep(3 * timeout_s)
        return httpx.Response(200, json=_chat_answer("sao-1"))

    params = _quick_params(clients=1, requests_per_client=1, stream_share=1.0 if stream else 0.0,
                           request_timeout_s=timeout_s)
    [record] = _run(params, handler).records
    assert record.error == "timeout" and record.latency_s < 2 * timeout_s, record
    assert record.status == (200 if stream else 0)  # a stream's status line had arrived
    assert "request_timeout_s (0.4 s)" in (record.detail or "")


def test_halt_stops_the_clients_early_and_says_why():
    """A process of the run's own stack that exits: the clients stop within HALT_POLL_S or so rather than
    hammer a dead serving for the whole duration."""
    from apps.load import gen

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "online-sao", "policy_version": 0}]})
        await asyncio.sleep(0.01)
        return httpx.Response(200, json=_chat_answer("sao-1"))

    calls = itertools.count()
    reason = "serving exited with -9; see serving.log"
    result = _run(_quick_params(duration_s=60.0), handler, halt=lambda: reason if next(calls) >= 1 else None)
    assert result.stopped_early == reason
    assert result.stopped_at_s is not None and result.stopped_at_s < 3 * gen.HALT_POLL_S
    assert result.wall_s < 3 * gen.HALT_POLL_S + 1.0
    assert result_json(result, summarize(result.records, result.wall_s, result.versions))["stopped_early"] == reason


@pytest.mark.parametrize("change", [{"requests_per_client": 0}, {"duration_s": float("nan")},
                                    {"duration_s": float("inf")}, {"request_timeout_s": float("nan")}],
                         ids=["no-requests", "nan-duration", "inf-duration", "nan-timeout"])
def test_load_params_refuse_what_cannot_run(change):
    """requests_per_client=0 went through ``or 1``: every client stopped before its first request."""
    with pytest.raises(ValueError):
        LoadParams(**change)


def test_the_plot_draws_the_last_partial_bucket_at_its_own_rate(tmp_path, monkeypatch):
    """A steady 10 answers/s for 32 s: the last bucket (30-32 s) was divided by the whole 5 s width
    and drawn as 4 answers/s, a drop that never happened."""
    import matplotlib.axes

    from apps.load.report import plot_latency
    from apps.load.stats import LoadResult

    records = [RequestRecord("chat", 0, i / 10 - 0.05, 0.05, 200, None, f"i{i}", (0,), 1) for i in range(1, 321)]
    result = LoadResult(LoadParams(duration_s=32.0), "http://x", 0.0, 32.0, records, [])
    heights: list[float] = []
    bar = matplotlib.axes.Axes.bar

    def recording_bar(self, x, height, *args, **kwargs):
        heights.extend(height)
        return bar(self, x, height, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", recording_bar)
    plot_latency(result, tmp_path / "load.png")
    assert heights and all(h == pytest.approx(10.0, rel=0.05) for h in heights), heights


def test_load_draws_its_rewards_in_the_configured_range(tmp_path, monkeypatch):
    """reward.min_value 0, max_value 1: the load sent rewards in [-1, 1] whatever the range, serving
    refused the negatives (422) and the run FAILED though serving behaved."""
    from apps import cli

    low, high = 0.0, 1.0
    rewards: list[float] = []

    def serving_like(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "online-sao", "policy_version": 0}]})
        if request.url.path == "/v1/feedback":
            reward = json.loads(request.content)["reward"]
            rewards.append(reward)
            return httpx.Response(200 if low <= reward <= high else 422, json={"status": "accepted"})
        return httpx.Response(200, json=_chat_answer(f"sao-{len(rewards)}-{id(request)}"))

    def run_against_fake(base_url, api_key, params, progress=print, halt=None):
        return asyncio.run(LoadGenerator(base_url, api_key, params, progress=lambda line: None, prompts=["p"],
                                         transport=httpx.MockTransport(serving_like)).run())

    monkeypatch.setattr("apps.load.gen.run_load", run_against_fake)
    out = tmp_path / "load.json"
    code = cli.main(["--set", f"reward.min_value={low}", "--set", f"reward.max_value={high}", "load",
                     "--url", "http://fake", "--clients", "2", "--requests-per-client", "20", "--stream-share", "0",
                     "--feedback-share", "1", "--no-kafka-check", "--summary-only", "--out", str(out)])
    assert len(rewards) == 40 and all(low <= reward <= high for reward in rewards), sorted(rewards)[:3]
    assert max(rewards) - min(rewards) > (high - low) / 2  # spread over the range, not pinned to a bound
    assert code == 0 and json.loads(out.read_text())["passed"]


@pytest.mark.parametrize("reward_range", [(1.0, 0.0), (0.0, 0.0), (float("nan"), 1.0), (0.0, float("inf"))])
def test_load_params_refuse_a_reward_range_to_draw_nothing_from(reward_range):
    with pytest.raises(ValueError, match="reward_range"):
        LoadParams(reward_range=reward_range)
