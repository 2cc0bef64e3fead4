"""Where held-out episodes go wrong: the first turn that leaves the oracle's path, by kind (table and research gyms).

Why (issue 12): held-out success at the run's temperature (1.3) ends near 0.5-0.6 whatever the training; this says
which step of the four-turn table task (lookup A, lookup B, calc "vA op vB", the bare number) or of the six-turn
research task (search A, read A, search B, read B, calc, "N [dA dB]") fails, before and after training, from the
evaluation tables a run already stores (`<run>/eval-before`, `<run>/eval-step-NNNN`).

    python bench/failure_modes.py runs/tiny [--out bench/results/cpu-failure-modes-DATE.json]
    python bench/failure_modes.py runs/tiny-research
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def _call(text: str) -> dict | None:
    m = re.search(r"<tool_call>(.*?)</tool_call>", text, re.S)
    if not m:
        return None
    try:
        return json.loads(m.group(1))
    except json.JSONDecodeError:
        return None


def classify(row: dict) -> str:
    """The first way the episode leaves the oracle's path (or "success")."""
    if row["success"]:
        return "success"
    task = json.loads(row["task"]) if isinstance(row["task"], str) else row["task"]
    d = task["data"]
    if "corpus" in d:
        return classify_research(row, task)
    table, a, b = d["table"], d["a"], d["b"]
    hist, obs = (json.loads(row[k]) if isinstance(row[k], str) else list(row[k]) for k in ("history", "observations"))
    looked: list[str] = []
    calc_value = None
    for t, text in enumerate(hist):
        is_call = "<tool_call>" in text
        if not is_call:  # a final answer
            nums = _NUM.findall(text)
            if calc_value is None:
                return "answered before calc" if len(looked) >= 2 else "answered before both lookups"
            if not nums:
                return "answer without a number"
            return "answer copies the calc result wrong" if Fraction(nums[-1]) != calc_value else "answer right, scored wrong"
        call = _call(text)
        if call is None or not isinstance(call, dict) or "name" not in call:
            return f"malformed tool call (turn {t})"
        args = call.get("arguments") or {}
        if call["name"] == "lookup":
            key = args.get("key")
            if key not in (a, b):
                return f"lookup of a key not asked ({'in table' if key in table else 'not in table'})"
            if key in looked:
                return "repeated lookup"
            looked.append(key)
        elif call["name"] == "calc":
            expr = str(args.get("expression", ""))
            if len(looked) < 2:
                return "calc before both lookups"
            nums = [Fraction(x) for x in _NUM.findall(expr)]
            if sorted(nums) != sorted([Fraction(table[a]), Fraction(table[b])]):
                return "calc copies a looked-up value wrong"
            o = obs[t] if t < len(obs) else ""
            got = _NUM.findall(o)
            if not got or o.startswith("error"):
                return "calc expression rejected"
            calc_value = Fraction(got[-1])
        else:
            return "unknown tool"
    return f"out of turns ({row['reason'] or 'unfinished'})"


def classify_research(row: dict, task: dict) -> str:
    """classify() for the research gym: search and read each source, calc "vA op vB", answer "N [dA dB]"."""
    from gyms.research import split_citations

    a, b = task["data"]["a"], task["data"]["b"]
    sources = {a["doc"], b["doc"]}
    hist, obs = (json.loads(row[k]) if isinstance(row[k], str) else list(row[k]) for k in ("history", "observations"))
    read: list[str] = []
    calc_value = None
    for t, text in enumerate(hist):
        if "<tool_call>" not in text:  # a final answer
            if len(read) < 2:
                return "answered before reading both sources"
            if calc_value is None:
                return "answered before calc"
            head, cited = split_citations(text)
            nums = _NUM.findall(head)
            if not nums:
                return "answer without a number"
            if Fraction(nums[-1]) != calc_value:
                return "answer copies the calc result wrong"
            if cited is None or not sources <= set(cited):
                return "answer right, citations missing a source"
            return "answer right, cites a document not read" if not set(cited) <= set(read) else \
                "answer right, scored wrong"
        call = _call(text)
        if call is None or not isinstance(call, dict) or "name" not in call:
            return f"malformed tool call (turn {t})"
        args = call.get("arguments") or {}
        o = obs[t] if t < len(obs) else ""
        if call["name"] == "search":
            continue  # searching is free; what it leads to is judged at the read
        if call["name"] == "read":
            doc = str(args.get("doc_id", "")).lower()
            if doc not in sources:
                return "read of a document not asked"
            if doc in read:
                return "repeated read"
            read.append(doc)
        elif call["name"] == "calc":
            if len(read) < 2:
                return "calc before reading both sources"
            nums = [Fraction(x) for x in _NUM.findall(str(args.get("expression", "")))]
            if sorted(nums) != sorted([Fraction(a["value"]), Fraction(b["value"])]):
                return "calc copies a read value wrong"
            got = _NUM.findall(o)
            if not got or o.startswith("error"):
                return "calc expression rejected"
            calc_value = Fraction(got[-1])
        else:
            return "unknown tool"
    return f"out of turns ({row['reason'] or 'unfinished'})"


def modes(eval_dir: Path) -> dict:
    from artifacts import read_table

    last = sorted(eval_dir.glob("gym-*.arrow"))[-1]
    rows = read_table(last).to_pylist()
    c = Counter(classify(r) for r in rows)
    return {"episodes": len(rows), "modes": dict(c.most_common())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    run = Path(a.run_dir)
    res = {"run_dir": str(run)}
    for d in sorted(run.glob("eval-*")):
        if d.is_dir() and list(d.glob("gym-*.arrow")):
            res[d.name] = modes(d)
            print(d.name, json.dumps(res[d.name]))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
