"""The built-in research gym: find two facts in a generated document corpus, combine them, answer with citations.

A deterministic corpus (from the options) describes fictional entities ("Tavrel", "Osmin") by counts of things
("mills", "wells", ...). Every fact lives in its own short document, e.g. ``d017``: ``Tavrel has 14 mills.``;
document ids are assigned in a seeded shuffled order, so an id says nothing about its entity. A question names two
facts and an operation ("What is Tavrel's mills plus Osmin's wells?").

Tools, served by a ``ToolService`` (in-process by default, or the HTTP tool server through ``tool_client``):

* ``search(query)`` lists up to ``search_k`` documents as ``d017 Tavrel mills`` lines (no values), ranked by word
  overlap with the query, ties by id;
* ``read(doc_id)`` returns the document text; its receipt (record hash, payload digest, revision) goes to the
  episode's sealed trace only, never to the model;
* ``calc(expression)``.

The oracle takes six turns: search A, read A, search B, read B, calc, then ``19 [d017 d031]`` (the number and the
documents it cites). With ``require_citations`` a final answer earns 1.0 only when its number is right, it cites
both source documents, and the sealed trace shows a successful ``read`` of every document it cites.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gyms.protocol import REASON_ANSWER, REASON_MAX_TURNS, EpisodeMetrics, StepResult, Task
from gyms.service import LocalToolClient, SealedEpisodeMixin, ToolClient, ToolOutput, ToolService
from gyms.table import final_number
from gyms.tools import (
    CALC_TOOL,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Tool,
    ToolCallError,
    ToolError,
    format_tool_call,
    one_arg_tool,
    parse_tool_call,
)
from gyms.trace import Receipt, TraceError, sha256_text, verify_entries

# Entity names are an onset syllable plus a coda syllable: short, pronounceable, few distinct BPE pieces.
_ONSETS = ("Ta", "Os", "Ve", "Mi", "Ka", "Lo", "Ne", "Ri", "Du", "Sa", "Be", "Fo")
_CODAS = ("vrel", "min", "dar", "lis", "tok", "ren", "mav", "sul", "pin", "gor")
ENTITY_NAMES: tuple[str, ...] = tuple(onset + coda for onset in _ONSETS for coda in _CODAS)

DEFAULT_ATTRIBUTES: tuple[str, ...] = ("mills", "wells", "towers", "bridges", "farms")
OPS: dict[str, str] = {"plus": "+", "minus": "-"}
SPLITS = ("train", "eval")
EVAL_MODULUS = 5  # a question key is in the eval split when its hash % 5 == 0 (about 20 %)
MAX_DOCS = 1000  # doc ids are "d" + 3 digits
MAX_REVISION = 9

_ATTRIBUTE_RE = re.compile(r"[a-z]{2,16}")
_WORD_RE = re.compile(r"[a-z0-9]+")
_ECHO_CHARS = 32
_MAX_SAMPLE_TRIES = 1000


@dataclass(frozen=True)
class Doc:
    """One document: a single fact (entity has value attribute) with its revision and receipt."""

    id: str
    entity: str
    attribute: str
    value: int
    revision: int
    text: str
    receipt: Receipt

    @property
    def index_line(self) -> str:
        """How ``search`` lists it: ``d017 Tavrel mills`` (no value)."""
        return f"{self.id} {self.entity} {self.attribute}"


@dataclass(frozen=True)
class Corpus:
    """The generated document collection. ``docs`` maps doc id -> Doc; ``by_fact`` maps (entity, attribute) -> id."""

    id: str
    entities: tuple[str, ...]
    attributes: tuple[str, ...]
    docs: dict[str, Doc]
    by_fact: dict[tuple[str, str], str]


def corpus_id(corpus_seed: int, n_entities: int, attributes: Sequence[str], max_value: int) -> str:
    """A digest of the generation options (16 hex chars): which corpus a receipt or task belongs to."""
    options = {"corpus_seed": corpus_seed, "n_entities": n_entities, "attributes": list(attributes),
               "max_value": max_value}
    return sha256_text(json.dumps(options, sort_keys=True))[:16]


def doc_receipt(cid: str, doc_id: str, revision: int, text: str) -> Receipt:
    return Receipt(record_hash=sha256_text(f"{cid}:{doc_id}:{revision}:{text}"), payload_digest=sha256_text(text),
                   revision=revision)


def build_corpus(corpus_seed: int, n_entities: int, attributes: Sequence[str], max_value: int) -> Corpus:
    """The deterministic corpus of these options (options are assumed valid: ``ResearchGym`` checks them)."""
    attributes = tuple(attributes)
    cid = corpus_id(corpus_seed, n_entities, attributes, max_value)
    rng = random.Random(f"research-corpus:{corpus_seed}")
    pool = [name for name in ENTITY_NAMES if name.lower() not in attributes]
    entities = tuple(rng.sample(pool, n_entities))
    facts = [(entity, attribute, rng.randint(1, max_value), rng.randint(1, MAX_REVISION))
             for entity in entities for attribute in attributes]
    numbers = list(range(len(facts)))
    rng.shuffle(numbers)
    docs: dict[str, Doc] = {}
    by_fact: dict[tuple[str, str], str] = {}
    for number, (entity, attribute, value, revision) in zip(numbers, facts):
        doc_id = f"d{number:03d}"
        text = f"{entity} has {value} {attribute}."
        docs[doc_id] = Doc(doc_id, entity, attribute, value, revision, text, doc_receipt(cid, doc_id, revision, text))
        by_fact[(entity, attribute)] = doc_id
    docs = dict(sorted(docs.items()))
    return Corpus(id=cid, entities=entities, attributes=attributes, docs=docs, by_fact=by_fact)


def question_split(entity_a: str, attribute_a: str, entity_b: str, attribute_b: str, op: str) -> str:
    """The split ("train" or "eval") that owns the question key, by a stable hash."""
    digest = hashlib.sha256(f"{entity_a}|{attribute_a}|{entity_b}|{attribute_b}|{op}".encode()).digest()
    return "eval" if digest[0] % EVAL_MODULUS == 0 else "train"


def split_citations(text: str) -> tuple[str, list[str] | None]:
    """(answer without its trailing ``[...]`` citation list, the cited tokens lower-cased or None when absent)."""
    stripped = text.rstrip()
    if not stripped.endswith("]"):
        return text, None
    start = stripped.rfind("[")
    if start == -1:
        return text, None
    return stripped[:start], [token.lower() for token in re.findall(r"[A-Za-z0-9]+", stripped[start + 1 : -1])]


def _short(text: str) -> str:
    return text if len(text) <= _ECHO_CHARS else text[:_ECHO_CHARS] + "..."


def _apply(op: str, x: int, y: int) -> int:
    return x + y if op == "plus" else x - y


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ResearchGym: {name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"ResearchGym: {name} must be {bound}, got {value}")
    return value


class ResearchGym(SealedEpisodeMixin):
    """Multi-turn search-read-calculate gym with cited answers checked against the sealed tool trace.

    Options: ``max_turns`` (default 8; the oracle needs 6), ``corpus_seed`` (0), ``n_entities`` (16, 2..120),
    ``attributes`` (lowercase words, default mills/wells/towers/bridges/farms), ``max_value`` (facts are drawn
    from 1..max_value, default 20), ``ops`` (subset of plus/minus, default both), ``search_k`` (lines per
    search, default 3), ``require_citations`` (default True), ``progress_reward`` (paid on the first successful
    read of each of the two source documents, default 0), ``tool_client`` (a ``ToolClient``; default None: a
    private in-process ``ToolService`` of ``server_tools()``).
    """

    def __init__(
        self,
        max_turns: int = 8,
        corpus_seed: int = 0,
        n_entities: int = 16,
        attributes: Sequence[str] = DEFAULT_ATTRIBUTES,
        max_value: int = 20,
        ops: Sequence[str] = tuple(OPS),
        search_k: int = 3,
        require_citations: bool = True,
        progress_reward: float = 0.0,
        tool_client: ToolClient | None = None,
    ) -> None:
        self.max_turns = _check_int("max_turns", max_turns, 1)
        self.corpus_seed = _check_int("corpus_seed", corpus_seed, 0)
        self.n_entities = _check_int("n_entities", n_entities, 2, len(ENTITY_NAMES))
        self.max_value = _check_int("max_value", max_value, 1, 10**6)
        self.search_k = _check_int("search_k", search_k, 1, 50)
        if isinstance(attributes, str) or not isinstance(attributes, Sequence) or not attributes:
            raise ValueError(f"ResearchGym: attributes must be a non-empty list of words, got {attributes!r}")
        bad = [a for a in attributes if not isinstance(a, str) or not _ATTRIBUTE_RE.fullmatch(a)]
        if bad:
            raise ValueError(f"ResearchGym: attributes must be lowercase words of 2..16 letters a-z, got {bad!r}")
        if len(set(attributes)) != len(attributes):
            raise ValueError(f"ResearchGym: attributes must be unique, got {list(attributes)}")
        if self.n_entities * len(attributes) > MAX_DOCS:
            raise ValueError(f"ResearchGym: n_entities * len(attributes) must be <= {MAX_DOCS} (doc ids have 3 "
                             f"digits), got {self.n_entities} * {len(attributes)}")
        self.attributes = tuple(attributes)
        names = [name for name in ENTITY_NAMES if name.lower() not in self.attributes]
        if self.n_entities > len(names):
            raise ValueError(f"ResearchGym: n_entities must be <= {len(names)} with these attributes, "
                             f"got {self.n_entities}")
        if isinstance(ops, str) or not isinstance(ops, Sequence):
            raise ValueError(f"ResearchGym: ops must be a list, a non-empty subset of {list(OPS)}, got {ops!r}")
        unknown = [op for op in ops if op not in OPS]
        if unknown or not ops:
            raise ValueError(f"ResearchGym: ops must be a non-empty subset of {list(OPS)}, got {list(ops)}")
        self.ops = tuple(dict.fromkeys(ops))
        if not isinstance(require_citations, bool):
            raise ValueError(f"ResearchGym: require_citations must be true or false, got {require_citations!r}")
        self.require_citations = require_citations
        if isinstance(progress_reward, bool) or not isinstance(progress_reward, (int, float)) \
                or not 0.0 <= progress_reward <= 1.0:
            raise ValueError(f"ResearchGym: progress_reward must be a number in [0, 1], got {progress_reward!r}")
        self.progress_reward = float(progress_reward)
        if tool_client is not None and not isinstance(tool_client, ToolClient):
            raise ValueError(f"ResearchGym: tool_client must have call(...) and seal(episode), "
                             f"got {type(tool_client).__name__}")

        self.corpus = build_corpus(self.corpus_seed, self.n_entities, self.attributes, self.max_value)
        self.tools: list[Tool] = self.server_tools()
        self.service: ToolService | None = None
        if tool_client is None:
            self.service = ToolService(self.tools)
            tool_client = LocalToolClient(self.service)
        self.client: ToolClient = tool_client
        self._split_keys: dict[str, list[tuple[str, str, str, str, str]]] = {}

        self._task: Task | None = None
        self._episode_id: str | None = None
        self._metrics = EpisodeMetrics()
        self._done = True
        self._sealed = True
        self._found: set[str] = set()
        self.trace_entries: list[dict[str, Any]] | None = None

    # -- tools -------------------------------------------------------------------------------------

    def server_tools(self) -> list[Tool]:
        """The tools a tool server serves for this corpus: search, read, calc (stateless, episode-independent)."""
        search = one_arg_tool("search", "Find documents; lists id, entity, attribute.", "query",
                              "words, e.g. Tavrel mills", self._search)
        read = one_arg_tool("read", "Text of a document.", "doc_id", "a document id, e.g. d017", self._read)
        return [search, read, CALC_TOOL]

    def search_ids(self, query: str) -> list[str]:
        """Ids of the documents matching ``query``, best first (word overlap, then id); all of them."""
        words = set(_WORD_RE.findall(query.lower()))
        scored = []
        for doc in self.corpus.docs.values():
            overlap = len(words & {doc.entity.lower(), doc.attribute})
            if overlap:
                scored.append((-overlap, doc.id))
        return [doc_id for _, doc_id in sorted(scored)]

    def _search(self, query: str) -> str:
        hits = self.search_ids(query)[: self.search_k]
        if not hits:
            raise ToolError(f"no documents match {_short(query)!r}; search for an entity name or an attribute")
        return "\n".join(self.corpus.docs[doc_id].index_line for doc_id in hits)

    def _read(self, doc_id: str) -> ToolOutput:
        doc = self.corpus.docs.get(doc_id.strip().lower())
        if doc is None:
            raise ToolError(f"unknown document {_short(doc_id)!r}: ids look like d017; use search to find them")
        return ToolOutput(doc.text, receipts=(doc.receipt,))

    def describe_tools(self) -> str:
        """A compact text description of the tools, the call format and the answer format."""
        lines = [f"{tool.signature()}: {tool.description}" for tool in self.tools]
        lines.append(f'Call: {TOOL_CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_CLOSE}')
        if self.require_citations:
            lines.append("Answer with the number and the ids you read, e.g. 19 [d017 d031].")
        else:
            lines.append("Answer with the number only.")
        return "\n".join(lines)

    # -- tasks ---------------------------------------------------------------------------------------

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        """``n`` tasks, deterministic in (seed, split, options); train and eval never share a question key."""
        if split not in SPLITS:
            raise ValueError(f"ResearchGym.sample_tasks: split must be one of {SPLITS}, got {split!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"ResearchGym.sample_tasks: n must be an integer >= 0, got {n!r}")
        rng = random.Random(f"research:{split}:{seed}")
        return [self._make_task(self._sample_key(rng, split), split, f"research-{split}-{seed}-{i:05d}")
                for i in range(n)]

    def _random_key(self, rng: random.Random) -> tuple[str, str, str, str, str]:
        facts = list(self.corpus.by_fact)
        (ea, aa), (eb, ab) = rng.sample(facts, 2)
        return ea, aa, eb, ab, rng.choice(self.ops)

    def _sample_key(self, rng: random.Random, split: str) -> tuple[str, str, str, str, str]:
        if split not in self._split_keys:
            for _ in range(_MAX_SAMPLE_TRIES):  # rejection sampling: uniform over the split's keys
                key = self._random_key(rng)
                if question_split(*key) == split:
                    return key
            # Only a tiny key space misses this often: enumerate it once and draw from the list.
            facts = list(self.corpus.by_fact)
            self._split_keys[split] = [
                (ea, aa, eb, ab, op) for (ea, aa) in facts for (eb, ab) in facts if (ea, aa) != (eb, ab)
                for op in self.ops if question_split(ea, aa, eb, ab, op) == split
            ]
        keys = self._split_keys[split]
        if not keys:
            raise ValueError(f"ResearchGym.sample_tasks: these options leave no question in the {split!r} split "
                             f"(use more entities, attributes or ops)")
        return rng.choice(keys)

    def _make_task(self, key: tuple[str, str, str, str, str], split: str, task_id: str) -> Task:
        ea, aa, eb, ab, op = key
        docs = self.corpus.docs
        a, b = docs[self.corpus.by_fact[(ea, aa)]], docs[self.corpus.by_fact[(eb, ab)]]
        question = f"What is {ea}'s {aa} {op} {eb}'s {ab}?"
        data = {
            "corpus": self.corpus.id,
            "a": {"doc": a.id, "entity": ea, "attribute": aa, "value": a.value},
            "b": {"doc": b.id, "entity": eb, "attribute": ab, "value": b.value},
            "op": op,
        }
        return Task(id=task_id, question=question, target=_apply(op, a.value, b.value), data=data)

    def _unpack(self, task: Task) -> tuple[dict[str, Any], dict[str, Any], str]:
        """(a, b, op) of a research task of this corpus, with a clear error otherwise."""
        data = task.data
        missing = [key for key in ("corpus", "a", "b", "op") if key not in data]
        if missing:
            raise ValueError(f"task {task.id!r} is not a research task: data lacks {missing}")
        if data["corpus"] != self.corpus.id:
            raise ValueError(f"task {task.id!r} belongs to corpus {data['corpus']!r}, this gym's is "
                             f"{self.corpus.id!r} (different corpus_seed, n_entities, attributes or max_value)")
        a, b, op = data["a"], data["b"], data["op"]
        for side in (a, b):
            doc = self.corpus.docs.get(side.get("doc")) if isinstance(side, dict) else None
            if doc is None or doc.value != side.get("value"):
                raise ValueError(f"task {task.id!r}: source {side!r} does not match the corpus")
        if op not in OPS or a["doc"] == b["doc"]:
            raise ValueError(f"task {task.id!r}: op must be one of {list(OPS)} and the two sources distinct")
        return a, b, op

    def oracle_answers(self, task: Task) -> list[str]:
        """The expert's turn texts: search A, read A, search B, read B, calc, the answer (with citations)."""
        a, b, op = self._unpack(task)
        answer = str(task.target)
        if self.require_citations:
            answer += f" [{a['doc']} {b['doc']}]"
        return [
            format_tool_call("search", {"query": f"{a['entity']} {a['attribute']}"}),
            format_tool_call("read", {"doc_id": a["doc"]}),
            format_tool_call("search", {"query": f"{b['entity']} {b['attribute']}"}),
            format_tool_call("read", {"doc_id": b["doc"]}),
            format_tool_call("calc", {"expression": f"{a['value']}{OPS[op]}{b['value']}"}),  # no spaces
            answer,
        ]

    # -- episode -------------------------------------------------------------------------------------

    @property
    def metrics(self) -> EpisodeMetrics:
        """Counters of the current (or last) episode."""
        return self._metrics

    @property
    def done(self) -> bool:
        """True before the first ``reset`` and after an episode ended."""
        return self._done

    @property
    def episode_id(self) -> str | None:
        return self._episode_id

    def reset(self, task: Task, episode_id: str | None = None) -> str:
        """Start an episode on ``task`` (tool calls and trace keyed by ``episode_id``, or a fresh uuid)."""
        self._unpack(task)
        if episode_id is None:
            episode_id = f"research-{uuid.uuid4().hex}"
        elif not isinstance(episode_id, str) or not episode_id:
            raise ValueError(f"ResearchGym.reset: episode_id must be a non-empty string, got {episode_id!r}")
        if self.service is not None and self._episode_id is not None and self._episode_id != episode_id:
            self.service.forget(self._episode_id)  # the private service keeps one episode at a time
        self._task = task
        self._episode_id = episode_id
        self._metrics = EpisodeMetrics()
        self._found = set()
        self._done = False
        self._sealed = False
        self.trace_entries = None
        return task.question

    def step(self, answer_text: str) -> StepResult:
        """One model turn: a final answer (no ``<tool_call>``) ends the episode; a tool call is executed.

        Never raises on model text. A ``ToolTransportError`` of the client propagates and leaves the episode as
        it was, so the same turn can be retried (its call id is the turn index: the service replays it).
        """
        if self._task is None or self._done:
            raise RuntimeError("ResearchGym.step: no episode running; call reset(task) first")
        turn = self._metrics.turns
        parsed = parse_tool_call(answer_text, self.tools)
        if parsed is None:
            entries = self._seal()  # may raise ToolTransportError: nothing has changed yet
            reward = 1.0 if self._answer_is_correct(answer_text, entries) else 0.0
            self._metrics.turns += 1
            return self._finish(None, reward, REASON_ANSWER, tool_error=False, tool_name=None, retries=0)
        retries = 0
        if isinstance(parsed, ToolCallError):
            observation, tool_error, tool_name = parsed.observation, True, parsed.tool_name
        else:
            reply = self.client.call(self._episode_id, str(turn), parsed.name, parsed.arguments)
            observation, tool_error, tool_name = reply.observation, bool(reply.is_error), parsed.name
            retries = len(reply.attempts)
        last = turn + 1 >= self.max_turns
        if last:
            self._seal()
        self._metrics.turns += 1
        self._metrics.tool_calls += 1
        if tool_error:
            self._metrics.tool_errors += 1
        reward = 0.0 if tool_error else self._progress(parsed.name, parsed.arguments)
        if last:
            return self._finish(observation, reward, REASON_MAX_TURNS, tool_error=tool_error, tool_name=tool_name,
                                retries=retries)
        return StepResult(observation, reward, False, self._info(tool_error, tool_name, None, retries))

    def _progress(self, name: str, arguments: dict[str, Any]) -> float:
        """``progress_reward`` for the first successful read of each of the two source documents."""
        if name != "read" or not self.progress_reward:
            return 0.0
        doc_id = str(arguments.get("doc_id", "")).strip().lower()
        sources = {self._task.data["a"]["doc"], self._task.data["b"]["doc"]}
        if doc_id in sources and doc_id not in self._found:
            self._found.add(doc_id)
            return self.progress_reward
        return 0.0

    def _answer_is_correct(self, text: str, entries: list[dict[str, Any]]) -> bool:
        """The number before the optional citation list equals the target, and (with ``require_citations``) the
        citations name both sources and only documents the sealed trace shows were read."""
        head, cited = split_citations(text)
        number = final_number(head)
        if number is None or number != self._task.target:
            return False
        if not self.require_citations:
            return True
        sources = {self._task.data["a"]["doc"], self._task.data["b"]["doc"]}
        if cited is None or not sources <= set(cited):
            return False
        read = self.read_records(entries, self._episode_id)
        for doc_id in cited:
            doc = self.corpus.docs.get(doc_id)
            if doc is None or doc.receipt.record_hash not in read:
                return False
        return True

    @staticmethod
    def read_records(entries: Any, episode_id: str) -> set[str]:
        """Record hashes of the receipts of the successful ``read`` calls of a verified trace; empty when the
        trace does not verify (an unverifiable trace proves no read)."""
        try:
            verify_entries(entries, episode_id)
            return {receipt["record_hash"] for entry in entries
                    if entry["kind"] == "call" and entry["tool"] == "read" and entry["status"] == "ok"
                    for receipt in entry["receipts"]}
        except (TraceError, TypeError, KeyError, AttributeError):
            return set()

    def _finish(self, observation: str | None, reward: float, reason: str, *, tool_error: bool,
                tool_name: str | None, retries: int) -> StepResult:
        self._done = True
        return StepResult(observation, reward, True, self._info(tool_error, tool_name, reason, retries))

    def _info(self, tool_error: bool, tool_name: str | None, reason: str | None, retries: int) -> dict[str, Any]:
        return {"tool_error": tool_error, "tool_name": tool_name, "reason": reason, "transport_retries": retries,
                **self._metrics.to_dict()}
