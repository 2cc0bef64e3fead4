"""Tests of the built-in research gym: corpus, tasks and splits, oracle, citations checked against the sealed trace,
tool errors, transport behaviour, registry, fuzzing."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from gyms import Env, GymRegistryError, ResearchGym, StepResult, Task, TaskSource, format_tool_call, make_env_factory
from gyms.registry import BUILTIN_GYMS
from gyms.research import ENTITY_NAMES, question_split, split_citations
from gyms.service import LocalToolClient, ToolReply, ToolService, ToolTransportError
from gyms.trace import TraceError, entry_hash, verify_entries

HEX64 = re.compile(r"[0-9a-f]{64}")


@pytest.fixture(scope="module")
def env() -> ResearchGym:
    return ResearchGym()


@pytest.fixture
def task(env: ResearchGym) -> Task:
    return env.sample_tasks(1, seed=7)[0]


def run_episode(env: ResearchGym, task: Task, answers: list[str], episode_id: str | None = None) -> list[StepResult]:
    env.reset(task, episode_id=episode_id)
    results = []
    for answer in answers:
        results.append(env.step(answer))
        if results[-1].done:
            break
    return results


def read_call(doc_id: Any) -> str:
    return format_tool_call("read", {"doc_id": doc_id})


def search_call(query: Any) -> str:
    return format_tool_call("search", {"query": query})


def sources(task: Task) -> tuple[str, str]:
    return task.data["a"]["doc"], task.data["b"]["doc"]


def other_doc(env: ResearchGym, task: Task) -> str:
    return next(doc_id for doc_id in env.corpus.docs if doc_id not in sources(task))


# -- protocol and corpus ----------------------------------------------------------------------------------


def test_env_follows_protocols(env: ResearchGym) -> None:
    assert isinstance(env, Env) and isinstance(env, TaskSource)
    assert [tool.name for tool in env.server_tools()] == ["search", "read", "calc"]
    text = env.describe_tools()
    assert "search(query: string)" in text and "read(doc_id: string)" in text and "calc(expression: string)" in text
    assert "[d017 d031]" in text and len(text) < 400
    assert "[" not in ResearchGym(require_citations=False).describe_tools().splitlines()[-1]


def test_corpus_is_deterministic_and_seeded() -> None:
    first, second = ResearchGym().corpus, ResearchGym().corpus
    assert first == second
    other = ResearchGym(corpus_seed=1).corpus
    assert other.id != first.id
    assert [d.text for d in other.docs.values()] != [d.text for d in first.docs.values()]
    assert ResearchGym(max_value=21).corpus.id != first.id  # the id digests every generation option


def test_every_fact_has_its_own_document(env: ResearchGym) -> None:
    corpus = env.corpus
    assert len(corpus.entities) == 16 and len(set(corpus.entities)) == 16
    assert all(name in ENTITY_NAMES and len(name) <= 7 for name in corpus.entities)
    assert len(corpus.docs) == 16 * 5 == len(corpus.by_fact)
    assert sorted(corpus.by_fact) == sorted((e, a) for e in corpus.entities for a in env.attributes)
    assert all(re.fullmatch(r"d\d{3}", doc_id) for doc_id in corpus.docs)
    for (entity, attribute), doc_id in corpus.by_fact.items():
        doc = corpus.docs[doc_id]
        assert (doc.entity, doc.attribute) == (entity, attribute)
        assert doc.text == f"{entity} has {doc.value} {attribute}." and 1 <= doc.value <= 20
        assert doc.receipt.revision == doc.revision and 1 <= doc.revision <= 9
        assert HEX64.fullmatch(doc.receipt.record_hash) and HEX64.fullmatch(doc.receipt.payload_digest)
    assert len({d.receipt.record_hash for d in corpus.docs.values()}) == len(corpus.docs)
    # ids are shuffled: the first entity's facts are not d000..d004
    first = [corpus.by_fact[(corpus.entities[0], a)] for a in env.attributes]
    assert first != [f"d{i:03d}" for i in range(5)]


# -- tasks and splits ---------------------------------------------------------------------------------------


def _key(task: Task) -> tuple[str, ...]:
    a, b = task.data["a"], task.data["b"]
    return a["entity"], a["attribute"], b["entity"], b["attribute"], task.data["op"]


def test_splits_are_disjoint(env: ResearchGym) -> None:
    train = {_key(t) for t in env.sample_tasks(2000, seed=0, split="train")}
    evaluation = {_key(t) for t in env.sample_tasks(2000, seed=0, split="eval")}
    assert len(train) > 1000 and len(evaluation) > 1000 and not train & evaluation
    assert all(question_split(*k) == "train" for k in train) and all(question_split(*k) == "eval" for k in evaluation)


def test_tasks_are_deterministic_and_well_formed(env: ResearchGym) -> None:
    tasks = env.sample_tasks(100, seed=11)
    assert tasks == ResearchGym().sample_tasks(100, seed=11)
    assert tasks != env.sample_tasks(100, seed=12)
    assert [t.id for t in tasks[:2]] == ["research-train-11-00000", "research-train-11-00001"]
    assert {t.data["op"] for t in tasks} == {"plus", "minus"}
    for t in tasks:
        a, b = t.data["a"], t.data["b"]
        assert a["doc"] != b["doc"]
        assert env.corpus.docs[a["doc"]].value == a["value"] and env.corpus.docs[b["doc"]].value == b["value"]
        assert t.target == (a["value"] + b["value"] if t.data["op"] == "plus" else a["value"] - b["value"])
        assert t.question == f"What is {a['entity']}'s {a['attribute']} {t.data['op']} {b['entity']}'s {b['attribute']}?"
        assert Task.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert {t.data["op"] for t in ResearchGym(ops=["plus"]).sample_tasks(50, seed=1)} == {"plus"}


def test_tiny_corpus_still_samples_both_splits() -> None:
    small = ResearchGym(n_entities=2, attributes=["mills"], ops=["plus", "minus"])
    for split in ("train", "eval"):
        tasks = small.sample_tasks(20, seed=0, split=split)
        assert all(question_split(*_key(t)) == split for t in tasks)


def test_task_of_another_corpus_is_rejected(task: Task) -> None:
    with pytest.raises(ValueError, match="belongs to corpus"):
        ResearchGym(corpus_seed=5).reset(task)
    with pytest.raises(ValueError, match="not a research task"):
        ResearchGym().reset(Task(id="x", question="q", target=1, data={"table": {}}))


# -- oracle ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "eval"])
def test_oracle_earns_full_reward_in_six_turns(env: ResearchGym, split: str) -> None:
    for task in env.sample_tasks(150, seed=3, split=split):
        results = run_episode(env, task, env.oracle_answers(task))
        assert [r.done for r in results] == [False] * 5 + [True], task
        assert results[-1].reward == 1.0 and results[-1].info["reason"] == "answer"
        assert results[-1].observation is None
        assert all(not r.info["tool_error"] and r.info["transport_retries"] == 0 for r in results)
        assert env.metrics.to_dict() == {"turns": 6, "tool_calls": 5, "tool_errors": 0}
        assert results[4].observation == str(task.target)


def test_oracle_texts(env: ResearchGym, task: Task) -> None:
    a, b = task.data["a"], task.data["b"]
    answers = env.oracle_answers(task)
    query = f"{a['entity']} {a['attribute']}"
    assert answers[0] == f'<tool_call>{{"name": "search", "arguments": {{"query": "{query}"}}}}</tool_call>'
    assert answers[1] == read_call(a["doc"]) and answers[3] == read_call(b["doc"])
    op = "+" if task.data["op"] == "plus" else "-"
    assert answers[4] == format_tool_call("calc", {"expression": f"{a['value']}{op}{b['value']}"})
    assert answers[5] == f"{task.target} [{a['doc']} {b['doc']}]"
    plain = ResearchGym(require_citations=False)
    assert plain.oracle_answers(task)[-1] == str(task.target)
    assert run_episode(plain, task, plain.oracle_answers(task))[-1].reward == 1.0


def test_oracle_search_ranks_the_needed_doc_first(env: ResearchGym) -> None:
    for task in env.sample_tasks(300, seed=4):
        answers = env.oracle_answers(task)
        env.reset(task)
        for turn, side in ((0, "a"), (2, "b")):
            observation = env.step(answers[turn]).observation
            lines = observation.split("\n")
            d = task.data[side]
            assert lines[0] == f"{d['doc']} {d['entity']} {d['attribute']}"
            assert len(lines) == 3 and all(len(line.split()) == 3 for line in lines)  # id entity attribute, no value
            env.step(answers[turn + 1])


def test_progress_reward_adds_up(task: Task) -> None:
    shaped = ResearchGym(progress_reward=0.25)
    results = run_episode(shaped, task, shaped.oracle_answers(task))
    assert [r.reward for r in results] == [0.0, 0.25, 0.0, 0.25, 0.0, 1.0]
    assert sum(r.reward for r in results) == 1.5
    a, _ = sources(task)
    rewards = [r.reward for r in run_episode(shaped, task, [read_call(a), read_call(a), read_call(other_doc(shaped, task))])]
    assert rewards == [0.25, 0.0, 0.0]
    assert run_episode(shaped, task, [read_call("d999")])[0].reward == 0.0


# -- observations and tool errors -------------------------------------------------------------------------------


def test_search_and_read_observations(env: ResearchGym, task: Task) -> None:
    a = task.data["a"]
    env.reset(task)
    assert env.step(read_call(a["doc"])).observation == f"{a['entity']} has {a['value']} {a['attribute']}."
    assert env.step(read_call(f" {a['doc'].upper()} ")).observation.endswith(f"{a['attribute']}.")
    listed = env.step(search_call(f"What is {a['entity']}'s {a['attribute']}?")).observation
    assert listed.split("\n")[0].startswith(a["doc"])
    assert ResearchGym(search_k=1).search_ids(a["entity"])[0] in env.corpus.docs


def test_unknown_doc_and_no_match_are_tool_errors(env: ResearchGym, task: Task) -> None:
    env.reset(task)
    result = env.step(read_call("d999"))
    assert result.observation.startswith("error: unknown document 'd999'") and "search" in result.observation
    assert result.info["tool_error"] is True and result.info["tool_name"] == "read" and not result.done
    result = env.step(search_call("zebra quokka"))
    assert result.observation.startswith("error: no documents match 'zebra quokka'")
    assert (env.metrics.tool_calls, env.metrics.tool_errors) == (2, 2)
    result = env.step("<tool_call>{bad</tool_call>")
    assert result.observation.startswith("error: tool call is not valid JSON") and result.info["tool_name"] is None
    assert env.metrics.to_dict() == {"turns": 3, "tool_calls": 3, "tool_errors": 3}


def test_observations_never_show_receipts(env: ResearchGym) -> None:
    for task in env.sample_tasks(40, seed=9):
        texts = env.oracle_answers(task)[:5] + [search_call(task.data["a"]["entity"]), read_call("d0")]
        for result in run_episode(env, task, texts):
            assert not HEX64.search(result.observation or "")


# -- citations and the sealed trace ------------------------------------------------------------------------------


def test_citations_must_be_read_according_to_the_trace(env: ResearchGym, task: Task) -> None:
    a, b = sources(task)
    other = other_doc(env, task)
    target = task.target
    oracle = env.oracle_answers(task)[:5]

    def final(text: str, calls: list[str] = oracle) -> float:
        return run_episode(env, task, [*calls, text])[-1].reward

    assert final(f"{target} [{a} {b}]") == 1.0
    assert final(f"The answer is {target} [{b}, {a}]") == 1.0
    assert final(f"{target} [{a} {b} {other}]") == 0.0  # cites a doc it never read
    assert final(f"{target} [{a} {b} {other}]", [*oracle, read_call(other)]) == 1.0  # extra read doc is fine
    assert final(f"{target}") == 0.0  # no citations
    assert final(f"{target} [{a}]") == 0.0  # one source missing
    assert final(f"{target + 1} [{a} {b}]") == 0.0  # wrong number
    assert final(f"{target} [{a} {b}]", oracle[:2] + oracle[4:]) == 0.0  # b searched but never read
    assert final(f"{target} [{a} {b}]", []) == 0.0  # right answer, nothing read
    assert final(f"{target} [{a} {b}]", [read_call(a), read_call(b)]) == 1.0


def test_number_only_mode_ignores_citations(task: Task) -> None:
    plain = ResearchGym(require_citations=False)
    a, b = sources(task)
    assert run_episode(plain, task, [str(task.target)])[-1].reward == 1.0
    assert run_episode(plain, task, [f"{task.target} [{a} {b}]"])[-1].reward == 1.0
    assert run_episode(plain, task, [f"{task.target + 1} [{a} {b}]"])[-1].reward == 0.0


def test_split_citations() -> None:
    assert split_citations("19 [d017 d031]") == ("19 ", ["d017", "d031"])
    assert split_citations("19 [D017,d031] \n") == ("19 ", ["d017", "d031"])
    assert split_citations("19") == ("19", None)
    assert split_citations("19]") == ("19]", None)


def test_sealed_trace_records_each_executed_call(task: Task) -> None:
    service = ToolService(ResearchGym().server_tools())
    env = ResearchGym(tool_client=LocalToolClient(service))
    assert env.service is None and env.close() is None
    answers = env.oracle_answers(task)
    texts = [answers[0], "<tool_call>{bad</tool_call>", answers[1], read_call("d999"), *answers[2:]]
    results = run_episode(env, task, texts, episode_id="run:1:0")
    assert results[-1].reward == 1.0
    entries = env.close()
    assert entries == env.trace_entries and env.close() == entries  # idempotent
    summary = verify_entries(entries, "run:1:0")
    calls = [e for e in entries if e["kind"] == "call"]
    assert summary.calls == len(calls) == 6  # the malformed call never reached the service
    assert [e["tool"] for e in calls] == ["search", "read", "read", "search", "read", "calc"]
    assert [e["call_id"] for e in calls] == ["0", "2", "3", "4", "5", "6"]
    assert [e["status"] for e in calls] == ["ok", "ok", "error", "ok", "ok", "ok"]
    a, b = sources(task)
    reads = [e for e in calls if e["tool"] == "read" and e["status"] == "ok"]
    assert [r["receipts"] for r in reads] == [[env.corpus.docs[a].receipt.to_dict()], [env.corpus.docs[b].receipt.to_dict()]]
    assert all(e["receipts"] == [] for e in calls if e not in reads)
    assert summary.read_records == (env.corpus.docs[a].receipt.record_hash, env.corpus.docs[b].receipt.record_hash)
    # a replayed call (client retry, or the driver rebuilding the episode) appends nothing
    replay = service.call("run:1:0", "2", "read", {"doc_id": a})
    assert replay == {"observation": env.corpus.docs[a].text, "is_error": False, "replayed": True}
    assert service.trace("run:1:0") == entries


def test_max_turns_ends_and_seals(task: Task) -> None:
    env = ResearchGym(max_turns=2)
    a, _ = sources(task)
    results = run_episode(env, task, [read_call(a), read_call(a), str(task.target)])
    assert len(results) == 2 and results[1].done and results[1].info["reason"] == "max_turns"
    assert results[1].observation is not None and results[1].reward == 0.0
    assert verify_entries(env.trace_entries).calls == 2
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("1")
    last = ResearchGym(max_turns=1)
    assert run_episode(last, task, [f"{task.target} [{a}]"])[-1].info["reason"] == "answer"


def test_close_mid_episode_seals_and_private_service_forgets(task: Task) -> None:
    env = ResearchGym()
    env.reset(task, episode_id="e1")
    env.step(read_call(task.data["a"]["doc"]))
    entries = env.close()
    assert env.done and verify_entries(entries, "e1").calls == 1 and entries[-1]["kind"] == "seal"
    env.reset(task, episode_id="e2")
    assert env.service.episodes() == []  # e1 dropped: the private service holds one episode at a time
    first = env.reset(task)
    assert first == task.question and env.episode_id.startswith("research-")
    with pytest.raises(ValueError, match="episode_id"):
        env.reset(task, episode_id="")


class _ForgingClient(LocalToolClient):
    """Seals, then tampers with the trace: claims a read the gym never made."""

    def __init__(self, service: ToolService, doc_receipt: dict[str, Any]) -> None:
        super().__init__(service)
        self.doc_receipt = doc_receipt

    def seal(self, episode: str) -> list[dict[str, Any]]:
        entries = super().seal(episode)
        first = dict(entries[0])
        first.update(tool="read", status="ok", receipts=[self.doc_receipt])
        first["hash"] = entry_hash(first)
        return [first, *entries[1:]]


def test_forged_trace_earns_nothing(task: Task) -> None:
    a, b = sources(task)
    base = ResearchGym()
    forger = _ForgingClient(ToolService(base.server_tools()), base.corpus.docs[b].receipt.to_dict())
    env = ResearchGym(tool_client=forger)
    results = run_episode(env, task, [search_call("x mills"), read_call(a), f"{task.target} [{a} {b}]"], "f1")
    with pytest.raises(TraceError):
        verify_entries(env.trace_entries, "f1")
    assert results[-1].reward == 0.0
    assert ResearchGym.read_records(None, "f1") == set() and ResearchGym.read_records([{"kind": 1}], "f1") == set()


# -- transport ----------------------------------------------------------------------------------------------------


class _FlakyClient(LocalToolClient):
    """Fails the first ``fail`` calls (and seals) with a transport error, then reports one retried attempt."""

    def __init__(self, service: ToolService, fail: int) -> None:
        super().__init__(service)
        self.fail = fail
        self.seen: list[tuple[str, str]] = []

    def _maybe_fail(self) -> None:
        if self.fail:
            self.fail -= 1
            raise ToolTransportError("server down", attempts=[{"attempt": 1, "kind": "connect"}])

    def call(self, episode: str, call_id: str, name: str, arguments: dict[str, Any]) -> ToolReply:
        self.seen.append((episode, call_id))
        self._maybe_fail()
        reply = super().call(episode, call_id, name, arguments)
        return ToolReply(reply.observation, reply.is_error, attempts=({"attempt": 1, "kind": "timeout"},))

    def seal(self, episode: str) -> list[dict[str, Any]]:
        self._maybe_fail()
        return super().seal(episode)


def test_transport_error_propagates_and_the_turn_can_be_retried(task: Task) -> None:
    client = _FlakyClient(ToolService(ResearchGym().server_tools()), fail=1)
    env = ResearchGym(tool_client=client)
    answers = env.oracle_answers(task)
    env.reset(task, episode_id="t1")
    with pytest.raises(ToolTransportError):
        env.step(answers[0])
    assert env.metrics.to_dict() == {"turns": 0, "tool_calls": 0, "tool_errors": 0} and not env.done
    result = env.step(answers[0])
    assert result.info["transport_retries"] == 1 and not result.info["tool_error"]
    assert client.seen == [("t1", "0"), ("t1", "0")]  # the retry reuses the call id
    for text in answers[1:5]:
        env.step(text)
    client.fail = 1
    with pytest.raises(ToolTransportError):
        env.step(answers[5])  # the seal failed: the final answer is not consumed
    assert not env.done and env.metrics.turns == 5
    final = env.step(answers[5])
    assert final.reward == 1.0 and final.info["transport_retries"] == 0
    assert verify_entries(env.trace_entries, "t1").calls == 5


# -- options and registry ---------------------------------------------------------------------------------------------


def test_registry_builds_research_gym() -> None:
    assert BUILTIN_GYMS["research"] is ResearchGym
    make = make_env_factory("research", {"max_turns": 8, "corpus_seed": 3, "progress_reward": 0.1,
                                         "attributes": ["mills", "wells"], "ops": ["plus"]})
    first, second = make(), make()
    assert isinstance(first, ResearchGym) and first is not second
    assert first.corpus == second.corpus and first.max_turns == 8 and len(first.corpus.docs) == 32
    assert first.service is not second.service
    with pytest.raises(GymRegistryError, match="options"):
        make_env_factory("research", {"colour": "red"})
    with pytest.raises(ValueError, match="search_k"):
        make_env_factory("research", {"search_k": 0})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_turns": 0}, "max_turns must be >= 1"),
        ({"n_entities": 1}, "n_entities must be in 2..120"),
        ({"n_entities": 8.5}, "n_entities must be an integer"),
        ({"max_value": 0}, "max_value must be"),
        ({"corpus_seed": True}, "corpus_seed must be an integer"),
        ({"attributes": "mills"}, "attributes must be a non-empty list"),
        ({"attributes": []}, "attributes must be a non-empty list"),
        ({"attributes": ["Mills"]}, "lowercase words"),
        ({"attributes": ["mills", "mills"]}, "attributes must be unique"),
        ({"attributes": [f"{c}{d}" for c in "abcdefghijklmnopqrstuvwxyz" for d in "abc"], "n_entities": 16},
         "n_entities \\* len\\(attributes\\) must be <= 1000"),
        ({"ops": ["times"]}, "ops must be a non-empty subset"),
        ({"ops": []}, "ops must be a non-empty subset"),
        ({"ops": "plus"}, "ops must be a list"),
        ({"progress_reward": 2.0}, "progress_reward must be a number in \\[0, 1\\]"),
        ({"require_citations": "yes"}, "require_citations must be true or false"),
        ({"tool_client": object()}, "tool_client must have call"),
    ],
)
def test_bad_options_are_rejected(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ResearchGym(**options)


def test_bad_sampling_arguments(env: ResearchGym) -> None:
    with pytest.raises(ValueError, match="split must be"):
        env.sample_tasks(1, seed=0, split="test")
    with pytest.raises(ValueError, match="n must be"):
        env.sample_tasks(-1, seed=0)


# -- fuzzing ----------------------------------------------------------------------------------------------------------


def _fuzz_texts(rng: random.Random, oracle: list[str]) -> list[str]:
    texts: list[str] = []
    for _ in range(600):  # random bytes, decoded leniently, with and without a tag around them
        raw_bytes = bytes(rng.randrange(256) for _ in range(rng.randrange(80)))
        for errors in ("replace", "surrogateescape"):
            raw = raw_bytes.decode("utf-8", errors=errors)
            texts += [raw, f"<tool_call>{raw}</tool_call>", f"<tool_call>{raw}", f"{raw} [d0{raw}]"]
    for call in oracle[:5]:  # every truncation of every valid call, and single-character mutations
        texts += [call[:cut] for cut in range(len(call) + 1)]
        for _ in range(100):
            pos = rng.randrange(len(call))
            char = chr(rng.choice([rng.randrange(32, 0x3000), rng.randrange(0xD800, 0xE000)]))  # surrogates too
            texts.append(call[:pos] + char + call[pos + 1 :])
    wrong_values: list[Any] = [0, -1, 3.5, True, False, None, [], ["d001"], {}, {"doc_id": "d001"}, {"a": {"b": [1]}}]
    for name, param in (("search", "query"), ("read", "doc_id"), ("calc", "expression")):
        for value in wrong_values:
            texts.append(format_tool_call(name, {param: value}))
        texts += [
            format_tool_call(name, {}),
            format_tool_call(name, {param: "d001", "extra": 1}),
            format_tool_call(name, {param: "a" * 1_000_000}),
            format_tool_call(name, {param: "\udcff\ud800 d001 mills"}),
            f'<tool_call>{{"name": "{name}", "arguments": {{"{param}": ' + "9" * 5001 + "}}</tool_call>",
            f'<tool_call>{{"name": "{name}", "arguments": {{"{param}": ' + "9" * 1500 + "}}</tool_call>",
            f'<tool_call>{{"name": "{name}", "arguments": ' + "[" * 10_000 + "</tool_call>",
            f'<tool_call>{{"name": "{name}", "arguments": ' + "[" * 900 + "]" * 900 + "}</tool_call>",
            f'<tool_call>{{"name": "{name}", "arguments": {{"{param}": "x"}}, "extra": [1, 2]}}</tool_call>',
            f'<tool_call>{{"name": "{name}", "arguments": "{param}"}}</tool_call>',
            f'<tool_call>{{"name": ["{name}"], "arguments": {{}}}}</tool_call>',
            f'<tool_call>{{"name": "{name}", "arguments": {{"{param}": NaN}}}}</tool_call>',
        ]
    for _ in range(300):  # random unicode (lone surrogates included) inside well-formed calls of every tool
        junk = "".join(chr(rng.randrange(0, 0x11000)) for _ in range(rng.randrange(40)))
        name, param = rng.choice([("search", "query"), ("read", "doc_id"), ("calc", "expression")])
        texts.append(format_tool_call(name, {param: junk}))
    texts += [
        format_tool_call("browse", {"url": "x"}),
        format_tool_call("", {}),
        "<tool_call>" * 1000,
        "</tool_call><tool_call>",
        "9" * 100_000,
        "1" * 100_000 + " [" + "d001 " * 10_000 + "]",
        "x" * 1_000_000,
        "[" * 100_000,
        "]" * 100_000,
        "19 [" + "[" * 1000 + "]",
        str(10**5000 // 10**1000),
        "",
    ]
    return texts


def test_fuzzed_tool_call_text_never_crashes(task: Task) -> None:
    env = ResearchGym(max_turns=8, progress_reward=0.25)
    rng = random.Random(2024)
    texts = _fuzz_texts(rng, env.oracle_answers(task))
    assert len(texts) > 5000
    finals = errors = 0
    for text in texts:
        if env.done:
            env.reset(task)
        result = env.step(text)
        assert isinstance(result, StepResult)
        if result.info["reason"] == "answer":
            finals += 1
            assert result.observation is None and result.done and result.reward in (0.0, 1.0)
        else:
            assert isinstance(result.observation, str) and len(result.observation) < 300
            if result.info["tool_error"]:
                errors += 1
                assert result.observation.startswith("error: ")
            result.observation.encode("utf-8")  # no lone surrogates reach the model
        if result.done:
            assert verify_entries(env.close()).episode == env.episode_id
    assert finals > 100 and errors > 2000
