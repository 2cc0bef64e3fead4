"""Scoring primitives for the teacher-forced probe and the failure diagnostic.

Every path that produces a log-prob for an answer token can be re-run in isolation here:

* ``teacher_forced``: one full forward over prefix ⊕ thoughts ⊕ answer (no cache: "prefix cache cleared"),
  alone or batched with other turns;
* ``cached_decode``: the sampler's own way: prefill the prompt embeddings, then feed the answer token by token
  through the incremental cache;
* ``static_decode``: the sampler's static-cache decoder (engine.cuda_graphs.GraphedDecoder), teacher-forced, either
  captured into a CUDA graph and replayed or run eagerly (same step function, kernels and buffers: bitwise equal by
  contract);
* ``adapter_layer_outputs``: the output of every adapter-wrapped Linear (LoRA/DoRA) for one input, to compare two
  engines layer by layer (bitwise where the arithmetic is the same); ``compare_adapter_layers`` does that comparison
  with one model's outputs on the host and one layer's on the device (full-size probes).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from engine import answers as AN
from engine import model as M
from engine import scoring as SC


@torch.no_grad()
def teacher_forced(model, prefixes: list[list[int]], thoughts: list[torch.Tensor], answers: list[list[int]],
                   temperature: float, toks: M.Tokens) -> list[torch.Tensor]:
    """Post-temperature log-softmax over the vocabulary at each answer position: [(L_i, V)] fp32."""
    _, head, _ = M._parts(model)
    hid = SC.turn_hidden(model, prefixes, thoughts, answers, toks)
    S = hid.shape[1]
    return [torch.log_softmax(head(hid[i, S - len(a):]).float() / temperature, -1) for i, a in enumerate(answers)]


def _forced_answer(model, h: torch.Tensor, answer: list[int], temperature: float, feed) -> torch.Tensor:
    """Teacher forcing after the prompt: the (L, V) post-temperature log-softmax at each answer position, where h is
    the prompt's last hidden state (1, d) and feed(embedding (1, 1, d)) advances the decoder and returns the next h."""
    _, head, emb = M._parts(model)
    out = []
    for i, tok in enumerate(answer):
        out.append(torch.log_softmax(head(h).float() / temperature, -1)[0])
        if i == len(answer) - 1:
            break
        h = feed(emb(torch.tensor([[tok]], device=h.device)))
    return torch.stack(out)


@torch.no_grad()
def cached_decode(model, prefix: list[int], thoughts: torch.Tensor, answer: list[int], temperature: float,
                  toks: M.Tokens) -> torch.Tensor:
    """The sampler's incremental path, teacher-forced: (L, V) post-temperature log-softmax, batch 1."""
    from transformers import DynamicCache

    text, _, _ = M._parts(model)
    x = AN.prompt_embeddings(model, prefix, thoughts, toks)[None]
    cache = DynamicCache(config=text.config)
    state = {"pos": torch.arange(x.shape[1], device=x.device)[None]}

    def run(e: torch.Tensor) -> torch.Tensor:
        out = text(inputs_embeds=e, position_ids=state["pos"], **M.cache_kw(cache), use_cache=True)
        state["pos"] = state["pos"][:, -1:] + 1
        return out.last_hidden_state[:, -1]

    return _forced_answer(model, run(x), answer, temperature, run)


@torch.no_grad()
def prefix_cached_decode(model, prefix: list[int], thoughts: torch.Tensor, answer: list[int], temperature: float,
                         toks: M.Tokens, cache) -> torch.Tensor:
    """The sampler's prefix-cached path (engine.prefix_cache), teacher-forced: the prefix restored from / prefilled
    into `cache` (None: computed alone), <think> ⊕ z ⊕ </think> as one chunk, then the answer tokens. (L, V)."""
    from engine import prefix_cache as PC

    text, _, emb = M._parts(model)
    dev = emb.weight.device
    kv, mask, pos = PC.stack_rows(PC.prefill_rows(model, [prefix], cache))
    state = {"mask": mask, "pos": pos}

    def run(e: torch.Tensor) -> torch.Tensor:
        h, state["mask"], state["pos"] = PC._decode_step(text, e, kv, state["mask"], state["pos"])
        return h

    x = torch.cat([emb(torch.tensor([[toks.think]], device=dev)), thoughts.to(device=dev, dtype=emb.weight.dtype)[None],
                   emb(torch.tensor([[toks.answer_open]], device=dev))], 1)
    return _forced_answer(model, run(x), answer, temperature, run)


@torch.no_grad()
def static_decode(model, prefix: list[int], thoughts: torch.Tensor, answer: list[int], temperature: float,
                  toks: M.Tokens, graphed: bool) -> tuple[torch.Tensor, dict[str, int]]:
    """The hf sampler's static-cache path, teacher-forced, batch 1: the prefix prefilled alone (no prefix cache),
    <think> ⊕ z ⊕ </think> as one chunk, then the answer tokens as decode steps -- warm-up, capture and CUDA-graph
    replay (graphed=True, CUDA only) or the identical steps run eagerly (graphed=False). A fresh decoder each call:
    nothing captured by the live engine is reused. Returns the (L, V) post-temperature log-softmax and the decoder's
    step counts (eager / warmup / capture / replay)."""
    from engine import prefix_cache as PC
    from engine.cuda_graphs import GraphedDecoder

    dec = GraphedDecoder(model, graphed=graphed)
    rows = PC.prefill_rows(model, [prefix], None)
    lsm = dec.forced_rows(rows, thoughts[None], answer, temperature, toks)[0]
    return lsm, dec.stats()["counts"]


def adapter_modules(model) -> dict[str, torch.nn.Module]:
    """Adapter-wrapped Linear layers (PEFT LoRA/DoRA) by module name."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            out[name] = module
    return out


@torch.no_grad()
def adapter_layer_outputs(model, prefix: list[int], thoughts: torch.Tensor, answer: list[int],
                          toks: M.Tokens, host: bool = False) -> dict[str, torch.Tensor]:
    """Every adapter layer's output for one teacher-forced turn (forward hooks; order = module order). host: each
    output is copied to the CPU as its layer runs (none stays on the model's device)."""
    outputs: dict[str, torch.Tensor] = {}
    with _layer_hooks(model, lambda name, out: outputs.__setitem__(
            name, out.detach().to("cpu", copy=True) if host else out.detach().clone())):
        SC.turn_hidden(model, [prefix], [thoughts], [answer], toks)
    return outputs


@contextmanager
def _layer_hooks(model, fn):
    """fn(name, output) after every adapter layer's forward, while inside."""
    hooks = [module.register_forward_hook(lambda _m, _inp, out, name=name: fn(name, out))
             for name, module in adapter_modules(model).items()]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _difference(name: str, x: torch.Tensor, y: torch.Tensor) -> dict | None:
    """None when two outputs of one layer are equal bit for bit (shape, dtype, values), else how they differ."""
    if x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y):
        return None
    diff = (x.float() - y.float()).abs().max().item() if x.shape == y.shape else float("inf")
    scale = x.float().abs().max().item() or 1.0
    return {"layer": name, "max_abs": diff, "relative": diff / scale, "dtypes": [str(x.dtype), str(y.dtype)]}


def _layers_report(names_a: list[str], names_b: list[str], differences: dict[str, dict | None]) -> dict:
    in_b = set(names_b)
    names = [n for n in names_a if n in in_b]
    differing = [differences[n] for n in names if differences[n] is not None]
    return {"layers": len(names), "missing": sorted(set(names_a) ^ set(names_b)), "differing": len(differing),
            "first_differing": differing[0] if differing else None, "worst": sorted(
                differing, key=lambda d: -d["relative"])[:5]}


def compare_layers(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """Layer-by-layer comparison of two engines' adapter-layer outputs for the same input.

    Returns the number of layers compared, how many are not bitwise equal, and the first such layer (in forward
    order) with its max abs difference and relative size."""
    return _layers_report(list(a), list(b), {n: _difference(n, a[n], b[n]) for n in a if n in b})


@torch.no_grad()
def compare_adapter_layers(model_a, toks_a: M.Tokens, model_b, toks_b: M.Tokens, prefix: list[int],
                           thoughts: torch.Tensor, answer: list[int]) -> dict:
    """``compare_layers(adapter_layer_outputs(model_a, ...), adapter_layer_outputs(model_b, ...))`` -- the same
    report -- without holding both models' outputs on a device: a's are copied to the host as its layers run, and
    each of b's is compared with a's as its layer runs, then dropped. Every adapter layer's output of one turn is
    ~7.8 MB per token at the 27B width (10 targets x 64 layers, BF16): ~28 GB for a 3.5k-token probe turn, so the
    two dictionaries side by side (56 GB) beside the NF4 model did not fit an 80 GB GPU (sampler.weights: trainer,
    where the probe compares layers at full size); here the device holds one layer's output at a time and the host
    one model's outputs."""
    a = adapter_layer_outputs(model_a, prefix, thoughts, answer, toks_a, host=True)
    differences: dict[str, dict | None] = {}  # b's layers in forward order; None: equal to a's (or a has none)

    def check(name: str, out: torch.Tensor) -> None:
        differences[name] = _difference(name, a[name], out.detach().to("cpu")) if name in a else None

    with _layer_hooks(model_b, check):
        SC.turn_hidden(model_b, [prefix], [thoughts], [answer], toks_b)
    return _layers_report(list(a), list(differences), differences)


# ----------------------------------------------------------------------------------------------------------------
# the sampler roles' isolated paths (engine.runtime.Engine / VllmEngine.diagnostic_paths)


def adapter_weight_check(engine_model, adapter_dir: str) -> dict:
    """Bitwise comparison of an engine's live adapter tensors with the adapter directory on disk."""
    from artifacts import read_adapter_dir

    _, disk = read_adapter_dir(adapter_dir)
    live = M.adapter_state(engine_model)
    differing = sorted(k for k in disk if k not in live or not torch.equal(live[k].float(), disk[k].float()))
    return {"tensors": len(disk), "differing": len(differing), "examples": differing[:4]}


def hf_graph_status(engine) -> dict:
    """Whether the graphed-vs-eager pair can run for the hf sampler: {"status": "run"} or "skipped" with why."""
    if engine.device.type != "cuda":
        return {"status": "skipped", "reason": f"no CUDA: the sampler runs on {engine.device.type}, where the static "
                                               "decoder runs eagerly and there is no graph to compare"}
    return {"status": "run", "used_by_run": bool(engine.graphs), "tokens": []}


def hf_paths(engine, cases: list[dict], T: float, trainer, fresh, adapter_dir: str) -> dict:
    """The hf sampler's isolated paths per case: alone, batched, incremental cache, prefix cache cold and as the run
    left it, a fresh engine (`fresh()` builds it: base from disk, adapter through PEFT), and on CUDA the static
    decoder graphed and eager (bitwise by contract; the comparison is recorded in "graph"). Also the adapter layers
    against the trainer's on the first case, and the live adapter tensors against `adapter_dir`."""
    m, toks = engine.model, engine.toks
    batched = teacher_forced(m, [c["prefix"] for c in cases], [c["thoughts"] for c in cases],
                             [c["answer"] for c in cases], T, toks)
    live_cache = engine.answer_cache(trainer)  # as it is (entries of the failed round)
    fresh_model = fresh()
    graph = hf_graph_status(engine)
    paths = []
    for i, c in enumerate(cases):
        p, z, a = c["prefix"], c["thoughts"], c["answer"]
        one = {"sampler/live-alone": teacher_forced(m, [p], [z], [a], T, toks)[0],
               "sampler/live-batched": batched[i],
               "sampler/live-cached": cached_decode(m, p, z, a, T, toks),
               "sampler/prefix-cache-cold": prefix_cached_decode(m, p, z, a, T, toks, None),
               "sampler/prefix-cache-live": prefix_cached_decode(m, p, z, a, T, toks, live_cache),
               "sampler/fresh-alone": teacher_forced(fresh_model, [p], [z], [a], T, toks)[0]}
        if graph["status"] == "run":
            g, counts = static_decode(m, p, z, a, T, toks, graphed=True)
            e, _ = static_decode(m, p, z, a, T, toks, graphed=False)
            graph["tokens"].append({**c["where"], "bitwise_equal": bool(torch.equal(g, e)),
                                    "max_abs_diff": float((g - e).abs().max()), "graph_replays": counts.get("replay", 0)})
            one.update({"sampler/static-graphed": g, "sampler/static-eager": e})
        paths.append(one)
    w = cases[0]
    layers = compare_adapter_layers(trainer.model, trainer.toks, m, toks, w["prefix"], w["thoughts"], w["answer"])
    return {"paths": paths, "graph": graph, "layers": layers, "weights": adapter_weight_check(m, adapter_dir)}


def vllm_paths(engine, cases: list[dict], T: float, trainer, adapter_dir: str) -> dict:
    """The vLLM sampler's isolated paths: teacher-forced alone and batched (its internals are not hookable); the
    adapter check compares versions (vLLM holds the adapter by LoRARequest)."""
    from artifacts import dir_digest

    batched = engine.teacher_forced([c["prefix"] for c in cases], [c["thoughts"] for c in cases],
                                    [c["answer"] for c in cases], T, trainer)
    paths = [{"sampler/live-alone": engine.teacher_forced([c["prefix"]], [c["thoughts"]], [c["answer"]], T, trainer)[0],
              "sampler/live-batched": batched[i]} for i, c in enumerate(cases)]
    stale = engine.adapter_digest != dir_digest(adapter_dir)
    return {"paths": paths,
            "graph": {"status": "skipped", "reason": "sampler.kind=vllm: its CUDA graphs are inside the engine, not "
                                                     "hookable (the isolated paths cover it alone / batched)"},
            "layers": {"layers": 0, "differing": 0, "first_differing": None, "note": "vLLM layers are not compared"},
            "weights": {"tensors": 1, "differing": int(stale), "examples": ["adapter version"] if stale else []}}
