"""Tests of the built-in tool gym: protocol, tool-call parsing, calc, table gym, registry, fuzzing."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gyms import (
    Env,
    GymRegistryError,
    StepResult,
    TableGym,
    Task,
    TaskSource,
    ToolCall,
    ToolCallError,
    calc,
    format_tool_call,
    make_env_factory,
    parse_tool_call,
)
from gyms.table import NAMES, triple_split
from gyms.tools import CALC_TOOL, MAX_TOOL_CALL_CHARS, Tool

REPO = Path(__file__).resolve().parents[1]


def lookup_call(key: object) -> str:
    return format_tool_call("lookup", {"key": key})


@pytest.fixture
def env() -> TableGym:
    return TableGym(max_turns=5)


@pytest.fixture
def task(env: TableGym) -> Task:
    return env.sample_tasks(1, seed=7)[0]


def run_episode(env: TableGym, task: Task, answers: list[str]) -> list[StepResult]:
    env.reset(task)
    results = []
    for answer in answers:
        results.append(env.step(answer))
        if results[-1].done:
            break
    return results


# -- protocol -------------------------------------------------------------------------------------


def test_env_follows_protocols(env: TableGym) -> None:
    assert isinstance(env, Env)
    assert isinstance(env, TaskSource)


def test_task_round_trips_through_json(task: Task) -> None:
    again = Task.from_dict(json.loads(json.dumps(task.to_dict())))
    assert again == task


def test_task_from_dict_says_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="missing field 'target'"):
        Task.from_dict({"id": "x", "question": "q"})
    with pytest.raises(TypeError, match="'target' must be"):
        Task.from_dict({"id": "x", "question": "q", "target": 1.5})


def test_gym_does_not_import_torch() -> None:
    code = "import sys, gyms, gyms.table, gyms.registry; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_the_gyms_package_does_not_shadow_pypi_gym() -> None:
    """The project's gyms live in `gyms` (no top-level `gym`): `import gym` from the project root finds only a gym
    package that is installed, never a folder of this repository."""
    code = ("import importlib.util, pathlib, sys; s = importlib.util.find_spec('gym'); "
            "root = pathlib.Path(sys.argv[1]).resolve(); "
            "assert s is None or root not in pathlib.Path(s.origin or '').resolve().parents, s")
    subprocess.run([sys.executable, "-c", code, str(REPO)], cwd=REPO, check=True)
    assert not (Path(REPO) / "gym").exists()


# -- oracle episodes --------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "eval"])
def test_oracle_solves_every_task_in_four_turns(env: TableGym, split: str) -> None:
    for task in env.sample_tasks(200, seed=3, split=split):
        results = run_episode(env, task, env.oracle_answers(task))
        assert len(results) == 4, task
        assert [r.done for r in results] == [False, False, False, True]
        assert results[-1].reward == 1.0
        assert results[-1].info["reason"] == "answer"
        assert results[-1].observation is None
        assert all(not r.info["tool_error"] for r in results)
        assert env.metrics.to_dict() == {"turns": 4, "tool_calls": 3, "tool_errors": 0}


def test_oracle_episode_texts(env: TableGym, task: Task) -> None:
    table, a, b = task.data["table"], task.data["a"], task.data["b"]
    answers = env.oracle_answers(task)
    assert answers[0] == f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{a}"}}}}</tool_call>'
    assert env.reset(task) == task.question
    assert task.question.startswith(f'What is "{a}" ')
    observations = [env.step(text).observation for text in answers]
    assert observations[:2] == [str(table[a]), str(table[b])]
    assert observations[2] == str(task.target)
    assert answers[3] == str(task.target)


def test_info_always_has_required_keys(env: TableGym, task: Task) -> None:
    for result in run_episode(env, task, ["<tool_call>oops</tool_call>", *env.oracle_answers(task)]):
        assert {"tool_error", "tool_name", "reason", "turns", "tool_calls", "tool_errors"} <= set(result.info)


# -- rewards and episode ends -----------------------------------------------------------------------


def test_wrong_answer_scores_zero(env: TableGym, task: Task) -> None:
    result = run_episode(env, task, [str(int(task.target) + 1)])[-1]
    assert (result.done, result.reward, result.info["reason"]) == (True, 0.0, "answer")


def test_answer_without_number_scores_zero(env: TableGym, task: Task) -> None:
    assert run_episode(env, task, ["I do not know"])[-1].reward == 0.0


def test_answer_in_a_sentence_uses_last_number(env: TableGym, task: Task) -> None:
    assert run_episode(env, task, [f"3 and 4 give {task.target}."])[-1].reward == 1.0


def test_max_turns_ends_episode_without_reward(task: Task) -> None:
    env = TableGym(max_turns=2)
    a = task.data["a"]
    results = run_episode(env, task, [lookup_call(a), lookup_call(a), str(task.target)])
    assert len(results) == 2
    assert results[0].done is False and results[0].info["reason"] is None
    assert results[1].done is True and results[1].reward == 0.0
    assert results[1].info["reason"] == "max_turns"


def test_final_answer_on_last_turn_still_counts(task: Task) -> None:
    env = TableGym(max_turns=1)
    result = run_episode(env, task, [str(task.target)])[-1]
    assert (result.reward, result.info["reason"]) == (1.0, "answer")


def test_step_after_done_is_a_clear_error(env: TableGym, task: Task) -> None:
    run_episode(env, task, ["0"])
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("1")


# -- malformed calls -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected", "tool_name"),
    [
        ('<tool_call>{"name": "lookup", "arguments": {"key": </tool_call>', "error: tool call is not valid JSON", None),
        ('<tool_call>{"name": "lookup"}</tool_call>', 'error: tool call needs "arguments"', "lookup"),
        ('<tool_call>{"arguments": {"key": "alpha"}}</tool_call>', 'error: tool call needs "name"', None),
        ('<tool_call>{"name": "lookup", "arguments": {"key": 3}}</tool_call>', "error: arguments.key must be a string", "lookup"),
        ('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', "error: arguments.key is required", "lookup"),
        ('<tool_call>{"name": "lookup", "arguments": {"key": "a", "x": 1}}</tool_call>', "error: arguments.x is not a parameter", "lookup"),
        ('<tool_call>{"name": "lookup", "arguments": "alpha"}</tool_call>', "error: arguments must be an object", "lookup"),
        ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "error: unknown tool 'search'", None),
        ('<tool_call>["lookup"]</tool_call>', "error: tool call must be a JSON object", None),
        ('<tool_call>{"name": "lookup", "arguments": {"key": "alpha"}}', "error: missing </tool_call>", None),
        ("<tool_call></tool_call>", "error: empty <tool_call>", None),
        (lookup_call("zzz"), "error: unknown key 'zzz'", "lookup"),
        (format_tool_call("calc", {"expression": "1/0"}), "error: division by zero", "calc"),
    ],
)
def test_malformed_call_gives_error_observation(
    env: TableGym, task: Task, text: str, expected: str, tool_name: str | None
) -> None:
    env.reset(task)
    result = env.step(text)
    assert result.observation is not None and result.observation.startswith(expected), result.observation
    assert result.done is False and result.reward == 0.0
    assert result.info["tool_error"] is True
    assert result.info["tool_name"] == tool_name
    assert (result.info["tool_calls"], result.info["tool_errors"]) == (1, 1)


def test_episode_continues_after_errors(env: TableGym, task: Task) -> None:
    results = run_episode(env, task, ["<tool_call>{bad</tool_call>", *env.oracle_answers(task)])
    assert len(results) == 5 and results[-1].reward == 1.0
    assert env.metrics.to_dict() == {"turns": 5, "tool_calls": 4, "tool_errors": 1}


def test_parse_tool_call_results() -> None:
    tools = [CALC_TOOL]
    assert parse_tool_call("42", tools) is None
    call = parse_tool_call('think first <tool_call>\n{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>', tools)
    assert call == ToolCall(name="calc", arguments={"expression": "1+1"})
    assert call.render() == '<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>'
    two = format_tool_call("calc", {"expression": "1"}) * 2
    assert isinstance(parse_tool_call(two, tools), ToolCallError)
    too_long = format_tool_call("calc", {"expression": "1" * MAX_TOOL_CALL_CHARS})
    assert parse_tool_call(too_long, tools).observation.startswith("error: tool call too long")
    deep = "<tool_call>" + "[" * 1990 + "</tool_call>"
    assert parse_tool_call(deep, tools).observation == "error: tool call JSON is nested too deeply"
    nan = '<tool_call>{"name": "calc", "arguments": {"expression": NaN}}</tool_call>'
    assert isinstance(parse_tool_call(nan, tools), ToolCallError)


def test_argument_types_integer_and_number() -> None:
    tool = Tool(
        name="pick",
        description="",
        parameters={
            "type": "object",
            "properties": {"i": {"type": "integer"}, "x": {"type": "number"}},
            "required": ["i"],
        },
        fn=lambda i, x=0: str(i + x),
    )

    def message(arguments: dict) -> str | None:
        parsed = parse_tool_call(format_tool_call("pick", arguments), [tool])
        return parsed.observation if isinstance(parsed, ToolCallError) else None

    assert message({"i": 1, "x": 2.5}) is None
    assert message({"i": 1.5}) == "error: arguments.i must be an integer"
    assert message({"i": True}) == "error: arguments.i must be an integer"
    assert message({"i": 1, "x": "2"}) == "error: arguments.x must be a number"


def test_bad_tool_declaration_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs a type"):
        Tool(name="t", description="", parameters={"type": "object", "properties": {"a": {}}}, fn=str)
    with pytest.raises(ValueError, match="not in properties"):
        Tool(name="t", description="", parameters={"type": "object", "properties": {}, "required": ["a"]}, fn=str)


# -- calc ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("7 + 12", "19"),
        ("26 * 29", "754"),
        ("3 - 17", "-14"),
        ("5 / 2", "2.5"),
        ("10 / 4 * 2", "5"),
        ("2 * (3 + 4) - 5", "9"),
        ("-(2 + 3) * -2", "10"),
        ("--4", "4"),
        ("1.5 + 1.5", "3"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.3333333333"),
        ("  ((8)) ", "8"),
        ("100 - 2 * 3 * 4 / 8", "97"),
        ("-" * 199 + "1", "-1"),
    ],
)
def test_calc_values(expression: str, expected: str) -> None:
    assert calc(expression) == expected


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 / 0", "error: division by zero"),
        ("4 / (2 - 2)", "error: division by zero"),
        ("__import__('os')", "error: unexpected '_'"),
        ("2 ** 3", "error: unexpected '*'"),
        ("1e9", "error: unexpected 'e'"),
        ("(1 + 2", "error: missing ')'"),
        ("1 +", "error: unexpected end of expression"),
        ("", "error: empty expression"),
        ("1" * 201, "error: expression too long"),
        ("9" * 16, "error: number too large"),
        ("99999999 * 99999999", "error: number too large"),
        ("(" * 40 + "1" + ")" * 40, "error: too many nested parentheses"),
    ],
)
def test_calc_errors(expression: str, expected: str) -> None:
    assert calc(expression).startswith(expected)


def test_calc_never_evaluates_python() -> None:
    for expression in ["open('x')", "os.system('ls')", "lambda: 1", "[1]", "1; 2", "1 if 1 else 2"]:
        assert calc(expression).startswith("error: ")


# -- tasks and splits -----------------------------------------------------------------------------------


def test_sampling_is_deterministic(env: TableGym) -> None:
    assert env.sample_tasks(50, seed=11) == TableGym().sample_tasks(50, seed=11)
    assert env.sample_tasks(50, seed=11) != env.sample_tasks(50, seed=12)


def test_train_and_eval_splits_are_disjoint(env: TableGym) -> None:
    def triples(split: str) -> set[tuple[str, str, str]]:
        return {(t.data["a"], t.data["b"], t.data["op"]) for t in env.sample_tasks(500, seed=0, split=split)}

    train, evaluation = triples("train"), triples("eval")
    assert train and evaluation and not train & evaluation
    assert all(triple_split(*t) == "eval" for t in evaluation)


def test_tasks_are_well_formed(env: TableGym) -> None:
    for task in env.sample_tasks(100, seed=5):
        table = task.data["table"]
        assert len(table) == 6 and set(table) <= set(NAMES)
        assert all(1 <= value <= 30 for value in table.values())
        assert task.data["a"] != task.data["b"]
        assert len(task.question) < 70 and task.question.endswith("?")
    assert len({task.id for task in env.sample_tasks(100, seed=5)}) == 100


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="ops must be"):
        TableGym(ops=("divide",))
    with pytest.raises(ValueError, match="table_size"):
        TableGym(table_size=1)
    with pytest.raises(ValueError, match="split must be"):
        TableGym().sample_tasks(1, seed=0, split="test")


def test_describe_tools_is_compact(env: TableGym) -> None:
    text = env.describe_tools()
    assert "lookup(key: string)" in text and "calc(expression: string)" in text
    assert len(text) < 300


# -- fuzzing ------------------------------------------------------------------------------------------------


def _fuzz_texts(rng: random.Random, oracle: list[str]) -> list[str]:
    texts: list[str] = []
    for _ in range(800):  # random bytes, with and without a tag around them
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(60))).decode("utf-8", errors="replace")
        texts += [raw, f"<tool_call>{raw}</tool_call>", f"<tool_call>{raw}"]
    for _ in range(1500):  # truncated / mutated oracle calls
        text = rng.choice(oracle[:3])
        cut = rng.randrange(len(text) + 1)
        pos = rng.randrange(len(text))
        texts += [text[:cut], text[:pos] + chr(rng.randrange(32, 0x3000)) + text[pos + 1 :]]
    huge = [
        format_tool_call("lookup", {"key": "a" * 100_000}),
        format_tool_call("calc", {"expression": "1+" * 95 + "1"}),
        format_tool_call("calc", {"expression": "9" * 1000}),
        '<tool_call>{"name": "calc", "arguments": {"expression": ' + "[" * 100_000 + "</tool_call>",
        '<tool_call>{"name": "calc", "arguments": {"expression": ' + "9" * 5000 + "}}</tool_call>",
        "<tool_call>" * 1000,
        "<tool_call>" + '{"a":' * 300 + "1" + "}" * 300 + "</tool_call>",
        "9" * 100_000,
        "x" * 1_000_000,
    ]
    return texts + huge


def test_fuzz_never_raises(env: TableGym, task: Task) -> None:
    rng = random.Random(1234)
    texts = _fuzz_texts(rng, env.oracle_answers(task))
    assert len(texts) > 4000
    for text in texts:
        parse_tool_call(text, env.tools)
        if env.done:
            env.reset(task)
        result = env.step(text)
        assert isinstance(result.observation, (str, type(None)))
        assert len(result.observation or "") < 200
        assert result.reward in (0.0, 1.0)


# -- registry -----------------------------------------------------------------------------------------------


def test_registry_builtin_name() -> None:
    make = make_env_factory("table", {"max_turns": 3})
    first, second = make(), make()
    assert isinstance(first, TableGym) and first is not second
    assert first.max_turns == 3


def test_registry_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_gym_mod.py").write_text(
        textwrap.dedent(
            """
            from gyms.table import TableGym

            def build(**options):
                return TableGym(**options)

            class NotAnEnv:
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(make_env_factory("my_gym_mod:build", {"max_turns": 2})(), TableGym)
    assert isinstance(make_env_factory("gyms.table:TableGym", {})(), TableGym)
    with pytest.raises(GymRegistryError, match="lacks reset"):
        make_env_factory("my_gym_mod:NotAnEnv", {})
    with pytest.raises(GymRegistryError, match="has no attribute"):
        make_env_factory("my_gym_mod:missing", {})


def test_registry_errors() -> None:
    with pytest.raises(GymRegistryError, match="cannot import module 'no_such_pkg.mod'"):
        make_env_factory("no_such_pkg.mod:Gym", {})
    with pytest.raises(GymRegistryError, match="unknown gym 'tabel'"):
        make_env_factory("tabel", {})
    with pytest.raises(GymRegistryError, match="options"):
        make_env_factory("table", {"colour": "red"})
    with pytest.raises(GymRegistryError, match="pkg.module:Factory"):
        make_env_factory("gyms.table:", {})


def test_progress_reward_pays_each_asked_lookup_once() -> None:
    env = TableGym(progress_reward=0.25)
    task = env.sample_tasks(1, seed=3)[0]
    answers = env.oracle_answers(task)
    env.reset(task)
    rewards = [env.step(answers[0]).reward, env.step(answers[0]).reward, env.step(answers[1]).reward]
    assert rewards == [0.25, 0.0, 0.25]
    other = next(k for k in task.data["table"] if k not in (task.data["a"], task.data["b"]))
    env.reset(task)
    assert env.step(format_tool_call("lookup", {"key": other})).reward == 0.0
    with pytest.raises(ValueError, match="progress_reward"):
        TableGym(progress_reward=2.0)
