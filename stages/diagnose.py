"""The failure diagnostic: runs only after a gate failed. It rebuilds the worst tokens exactly (prompt, sampled
thoughts, adapter) and scores each on every path that can be isolated, then writes which path disagrees.

Paths (the reference is a trainer freshly loaded from disk: base + the step's adapter through PEFT's loader):

* ``trainer/gate``: the trainer's value the gate saw (replay, batched in micro-batches);
* ``trainer/live-alone``: the live trainer engine, this turn alone;
* ``sampler/rollout``: the sampler's value recorded during the rollout (batched, incremental cache);
* ``sampler/live-alone``: the live sampler engine, teacher-forced alone, no cache (prefix cache cleared);
* ``sampler/live-batched``: the live sampler engine, the worst turns batched together, no cache;
* ``sampler/live-cached``: the live sampler engine decoding through its incremental cache, alone;
* ``sampler/fresh-alone``: a sampler freshly loaded (export checkpoint + the step's adapter from disk), alone;
* ``sampler/static-graphed``, ``sampler/static-eager`` (hf sampler on CUDA): the static-cache decoder of
  engine.cuda_graphs, teacher-forced alone, its decode steps captured into a CUDA graph and replayed vs run eagerly
  (same step function and buffers: equal bit for bit by contract). Without CUDA there is no graph: the result's
  ``graph_vs_eager`` names the pair as skipped and why (also for the vLLM sampler, whose graphs are its own).

Two direct checks name the cause when a path disagrees: the live sampler's adapter weights against the step's
adapter on disk (stale or corrupted weights), and every adapter layer's output of the live sampler against the
trainer's on the worst turn (same weights, different arithmetic: e.g. a DoRA path that rounds twice).
Output: <step>/diagnostic-<gate>.json.
"""

from __future__ import annotations

import torch

from artifacts import RunDir, dir_digest, read_table, to_tensor_list, write_json
from stages.context import run_config, timer

TOL = 0.02  # nat: bf16 cached-vs-full decode differs by ~4e-4 here (fp32: ~2e-7); a defect shows far above


def _token_lp(lsm: torch.Tensor, answer: list[int], j: int) -> float:
    return float(lsm[j, answer[j]])


def _verdict(paths: dict[str, float], weights: dict, layers: dict) -> tuple[list[str], str]:
    ref = paths["trainer/fresh"]
    bad = sorted(p for p, v in paths.items() if p != "trainer/fresh" and abs(v - ref) > TOL)
    sampler_live = [p for p in bad if p.startswith("sampler/live") or p == "sampler/rollout"]
    if weights["differing"]:
        return bad, (f"sampler engine adapter weights: {weights['differing']} of {weights['tensors']} tensors differ "
                     "from the step's adapter on disk (a stale or corrupted adapter in the live sampler; a fresh "
                     "load of the same adapter " + ("agrees" if "sampler/fresh-alone" not in bad else "disagrees too")
                     + ")")
    if layers.get("first_differing"):
        f = layers["first_differing"]
        return bad, (f"sampler layer arithmetic: with identical adapter weights, layer {f['layer']} of the live "
                     f"sampler differs from the trainer's (max abs {f['max_abs']:.3g}, {f['relative']:.2g} of its "
                     f"output; {layers['differing']} of {layers['layers']} adapter layers differ)")
    if "trainer/live-alone" in bad:
        return bad, "trainer engine state: the live trainer differs from a fresh load of the same adapter"
    if "trainer/gate" in bad and "trainer/live-alone" not in bad:
        return bad, "trainer batching: the replay micro-batch value differs from the same turn scored alone"
    if sampler_live == ["sampler/live-batched"]:
        return bad, "sampler batching: batched teacher forcing differs from the same turn alone"
    if "sampler/static-graphed" in bad and "sampler/static-eager" not in bad:
        return bad, ("sampler CUDA graph replay: the graphed static decode differs from the same steps run eagerly "
                     "(a stale capture: buffers re-bound or constants changed since the graph was captured)")
    if "sampler/live-cached" in bad and "sampler/live-alone" not in bad:
        return bad, "sampler incremental cache: decoding through the cache differs from a full forward"
    if "sampler/prefix-cache-live" in bad and "sampler/prefix-cache-cold" not in bad:
        return bad, ("sampler prefix cache: a stored prefix state differs from the same prefix computed afresh "
                     "(stale entries: the cache was not cleared when the adapter changed)")
    if bad == ["sampler/rollout"]:
        return bad, ("sampler rollout path only: every isolated path agrees with the trainer, the recorded rollout "
                     "value does not (state carried between requests, e.g. a reused prefix cache)")
    if not bad:
        return bad, "no isolated path disagrees beyond tolerance"
    return bad, "paths disagree: " + ", ".join(bad)


def _analyse(cfg, trainer, sampler, fresh_t, fresh_sampler, cases: list[dict], gate_values, adapter_in: str):
    """Every isolated path per case: the trainer's (fresh engine, live alone, the gate's value) here, the sampler's
    from its role (engine.runtime: hf or vLLM, whichever paths it can expose)."""
    from engine import diagnose as D

    T = cfg.sampler.temperature
    sp = sampler.diagnostic_paths(cases, T, trainer, fresh_sampler, adapter_in)
    tokens = []
    for i, c in enumerate(cases):
        p, z, a, j = c["prefix"], c["thoughts"], c["answer"], c["token"]
        paths = {
            "trainer/fresh": _token_lp(D.teacher_forced(fresh_t, [p], [z], [a], T, trainer.toks)[0], a, j),
            "trainer/gate": gate_values[i][0],
            "trainer/live-alone": _token_lp(D.teacher_forced(trainer.model, [p], [z], [a], T, trainer.toks)[0], a, j),
            "sampler/rollout": gate_values[i][1],
            **{name: _token_lp(lp, a, j) for name, lp in sp["paths"][i].items()},
        }
        tokens.append({**c["where"], "token_id": a[j], "paths": paths})
    return tokens, sp["layers"], sp["graph"], sp["weights"]


def diagnose(run_dir: str, step: int, gate: str, report: dict, adapter_in: str, base_in: str,
             rollouts_in: str | None = None) -> dict:
    """Rebuild the worst tokens of a failed gate (rollout-parity: from rollouts_in; teacher-forced-probe: the probe
    set) on every isolated path; write <step>/diagnostic-<gate>.json and return it."""
    from engine import runtime
    from stages.export import export_base
    from stages.probe import probe_inputs

    cfg = run_config(run_dir)
    out = {"stage": "diagnose", "gate": gate, "step": step}
    with timer(out):
        export = export_base(run_dir, base_in)["path"]
        trainer = runtime.trainer(cfg, base_in, base_in)
        trainer.use_adapter(adapter_in)
        sampler = runtime.sampler(cfg, export, base_in)  # as it is: the diagnostic must not repair it
        cases, gate_values = [], []
        if gate == "rollout-parity":
            t = read_table(rollouts_in)
            prefixes, answers = t.column("prefix_ids").to_pylist(), t.column("answer_ids").to_pylist()
            thoughts = to_tensor_list(t, "thoughts", torch.float32)
            for w in report.get("worst_tokens", [])[:4]:
                i = w["turn"]
                cases.append({"prefix": prefixes[i], "thoughts": thoughts[i], "answer": answers[i], "token": w["token"],
                              "where": {"turn": i, "token": w["token"]}})
                gate_values.append((w["trainer"], w["sampler"]))
        elif gate == "teacher-forced-probe":
            prefixes, thoughts, answers = probe_inputs(cfg, trainer, base_in)
            w = report["worst"]
            cases.append({"prefix": prefixes[w["prompt"]], "thoughts": thoughts[w["prompt"]],
                          "answer": answers[w["prompt"]], "token": w["token"],
                          "where": {"prompt": w["prompt"], "token": w["token"]}})
            gate_values.append((w["trainer"], w["sampler"]))
        else:
            raise ValueError(f"no diagnostic for gate {gate!r}")
        if not cases:
            raise ValueError(f"gate {gate} report names no tokens to rebuild")
        # engines built as a new process would (device, NF4, attention), adapter through PEFT's own loader
        fresh_t = runtime.build(cfg, base_in, base_in, quantization=cfg.model.quantization, adapter_dir=adapter_in,
                                via_peft=True).model
        tokens, layers, graph, weights = _analyse(
            cfg, trainer, sampler, fresh_t,
            lambda: (runtime.build(cfg, export, base_in, adapter_dir=adapter_in, via_peft=True)
                     if runtime.sampler_on_trainer(export) is None  # sampler.weights: trainer -- the trainer's base
                     else runtime.build(cfg, base_in, base_in, quantization=cfg.model.quantization,
                                        adapter_dir=adapter_in, via_peft=True)).model,
            cases, gate_values, adapter_in)
        weights.update(engine_digest=sampler.adapter_digest, step_digest=dir_digest(adapter_in))
        guilty: set[str] = set()
        verdicts = []
        for tk in tokens:
            bad, verdict = _verdict(tk["paths"], weights, layers)
            tk["disagree"] = bad
            guilty.update(bad)
            verdicts.append(verdict)
        result = {"gate": gate, "step": step, "tolerance": TOL, "reference": "trainer/fresh",
                  "verdict": max(set(verdicts), key=verdicts.count), "disagreeing_paths": sorted(guilty),
                  "adapter_weights": weights, "layers": layers, "graph_vs_eager": graph, "tokens": tokens}
        path = RunDir(run_dir).diagnostic(step, gate)
        write_json(path, result)
        out.update(path=str(path), verdict=result["verdict"], disagreeing_paths=result["disagreeing_paths"],
                   graph_vs_eager=graph["status"])
    return out
