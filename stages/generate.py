"""sample-tasks and generate-turn: the model's side of a rollout round.

generate-turn, for every active row: the policy's latent loop samples K thoughts (z = mu + sigma*eps, seeded per
(run seed, step, turn, row)) with their log-densities -- on the trainer's model, or (`latent.engine`; auto for an NF4
base) on the hf sampler's BF16 export of the same weights and adapter; the sampler writes the answer from the prompt
embeddings prefix ⊕ thoughts ⊕ answer-open and returns its processed log-probs. Output: turn-TT.arrow.
"""

from __future__ import annotations


import numpy as np

from artifacts import RunDir, read_table
from artifacts.tables import write_turn
from engine.chat import ChatFormat, tool_specs
from stages import faults
from stages.context import env_factory, run_config, run_tag, seed_for, timer


def sample_tasks(run_dir: str, step: int, base_in: str, split: str = "train", n_groups: int | None = None,
                 out_path: str | None = None, scope: str | None = None) -> dict:
    """Tasks of one fresh step: `groups_per_step` tasks, each repeated `num_generations` times (a GRPO group).

    Writes the initial row state (tasks.arrow, columns of ``artifacts.tables.write_state``): row, group, a run-unique
    episode id (``<run tag>:<scope>:<row>``, scope ``s<step>`` by default), task json, prefix ids, done flags...
    """
    from engine.runtime import tokenizer
    from artifacts.tables import initial_row, write_state

    cfg = run_config(run_dir)
    rd = RunDir(run_dir)
    out = {"stage": "sample-tasks"}
    with timer(out):
        env = env_factory(cfg)()
        n_groups = n_groups or cfg.grpo.groups_per_step
        seed = seed_for(cfg.seed, cfg.gym.train_split_seed, step, split) % (2**31)
        tasks = env.sample_tasks(n_groups, seed=seed, split=split)
        tok = tokenizer(base_in)
        G = cfg.grpo.num_generations if split == "train" else 1
        rows = [(g, t) for g, t in enumerate(tasks) for _ in range(G)]
        fmt, tools = ChatFormat.of(tok), tool_specs(env)  # the tokenizer's chat template, or the built-in format
        prefixes = [np.asarray(tok(fmt.first_prompt(env.reset(t), tools))["input_ids"], dtype=np.int32)
                    for _, t in rows]
        path = out_path or str(rd.ensure(step).tasks(step))
        scope = scope or f"s{step}"
        write_state(path, [initial_row(i, g, f"{run_tag(run_dir)}:{scope}:{i}", t.to_dict(), prefixes[i])
                           for i, (g, t) in enumerate(rows)], metadata={"step": str(step), "split": split})
        out.update(path=path, rows=len(rows), groups=n_groups)
    return out


@faults.kill_window("generate-turn")
def generate_turn(run_dir: str, step: int, turn: int, state_in: str, adapter_in: str, export_in: str,
                  base_in: str, out_path: str | None = None, rows: list[int] | None = None) -> dict:
    """One model turn for the active rows of `state_in` (tasks.arrow or the previous gym-TT.arrow): the trainer's
    latent thoughts, the sampler's answers (each engine picks its own path), the turn table. rows: only these rows
    (a pool worker's share, engine/pool.py; gather_turn joins the shards)."""
    from engine import runtime

    cfg = run_config(run_dir)
    runtime.set_threads(cfg.threads)
    out = {"stage": "generate-turn", "turn": turn}
    with timer(out):
        state = read_table(state_in)
        done = state.column("done").to_numpy(zero_copy_only=False)
        active = [i for i in range(state.num_rows) if not done[i] and (rows is None or i in rows)]
        prefixes_all = state.column("prefix_ids").to_pylist()
        prefixes = [prefixes_all[i] for i in active]
        # an answer may use what is left of the episode's token budget, minus one for the <|im_end|> that closes it
        spent = (state.column("model_tokens").to_numpy() + state.column("tool_tokens").to_numpy()).tolist()
        limits = [max(1, cfg.gym.token_budget - int(spent[i]) - 1) for i in active]
        bounds_all = (state.column("prefix_bounds").to_pylist() if "prefix_bounds" in state.column_names
                      else None)  # tables written before the column existed: no fixed chunk layout
        boundaries = [bounds_all[i] for i in active] if bounds_all is not None else None
        tok_dir = base_in  # the base checkpoint carries its tokenizer
        trainer = runtime.trainer(cfg, base_in, tok_dir)
        trainer.use_adapter(adapter_in)
        sampler = runtime.sampler(cfg, export_in, tok_dir)
        sampler.use_adapter(adapter_in)
        caches = list({id(c): c for c in (trainer.prefix_cache, sampler.answer_cache(trainer)) if c is not None}.values())
        before = [(c.input_tokens, c.computed_tokens) for c in caches]
        K = cfg.latent.max_latent_steps
        sigma = cfg.latent.sigma * trainer.scale
        thinker = runtime.latent_engine(cfg, trainer, sampler)  # latent.engine: the trainer's model or the export's
        think_cache = sampler.answer_cache(trainer) if thinker is sampler else trainer.prefix_cache  # one per model
        out["latent_engine"] = "trainer" if thinker is trainer else "sampler"  # sampler.weights: trainer -- one
        with timer(out, "latent_s"):
            # one generator per row, seeded by (run seed, step, turn, row): a row's thoughts and answer are the same
            # whatever rows share its batch or worker (engine/rng.py)
            z, logq = thinker.thoughts(prefixes, boundaries, K, sigma,
                                       [seed_for(cfg.seed, step, turn, "latent", i) for i in active], think_cache,
                                       times=out)
        with timer(out, "answers_s"):
            ids, lps = sampler.answers(prefixes, boundaries, z, cfg.sampler.max_answer_tokens, cfg.sampler.temperature,
                                       [seed_for(cfg.seed, step, turn, "sampler", i) for i in active], limits, trainer,
                                       times=out)
        z, logq = z.cpu(), logq.cpu()
        for role, stats in (("latent", thinker.graph_stats("latent")), ("answers", sampler.graph_stats("answers"))):
            if stats:  # CUDA graphs: captures so far in this process and their warm-up + capture seconds
                out[f"{role}_graph_captures"], out[f"{role}_graph_setup_s"] = stats["captures"], stats["setup_s"]
        if caches:  # prefix tokens the engines asked for vs ran through a model (both engines, this turn)
            out["prefix_input_tokens"] = sum(c.input_tokens - b[0] for c, b in zip(caches, before))
            out["prefix_computed_tokens"] = sum(c.computed_tokens - b[1] for c, b in zip(caches, before))
        faults.maybe_kill("generate-turn", step)  # a drill: killed mid-turn, before the turn table is written
        tok = runtime.tokenizer(tok_dir)
        texts = [answer_text(tok, a, trainer.toks.eos) for a in ids]
        d = z.shape[-1]
        path = out_path or str(RunDir(run_dir).turn(step, turn))
        write_turn(path, active, prefixes, [z[i].numpy() for i in range(len(active))],
                   [logq[i].numpy() for i in range(len(active))], ids, lps, texts, step=step, turn=turn, K=K, d=d,
                   sigma=sigma)
        out.update(path=path, rows=len(active), answer_tokens=sum(len(a) for a in ids),
                   prefix_tokens=sum(len(p) for p in prefixes))
    return out


def answer_text(tok, ids: list[int], eos: int) -> str:
    """The text the gym sees for one answer (a closing <|im_end|> dropped). A model's vocabulary can be larger than
    its tokenizer's (padded embedding rows: the 27B shape has 248,320 rows; the random-weight presets keep the
    project's small tokenizer): an id the tokenizer does not know shows as ``<|id:N|>`` instead of vanishing, so
    answers that differ in such ids differ in text too (the synthetic gym's reward hashes the text)."""
    ids = list(ids[:-1] if ids and ids[-1] == eos else ids)
    n = len(tok)
    if all(i < n for i in ids):
        return tok.decode(ids, skip_special_tokens=False)
    parts, run = [], []
    for i in ids:
        if i < n:
            run.append(i)
            continue
        if run:
            parts.append(tok.decode(run, skip_special_tokens=False))
            run = []
        parts.append(f"<|id:{i}|>")
    if run:
        parts.append(tok.decode(run, skip_special_tokens=False))
    return "".join(parts)


def gather_turn(shards: list[str], out_path: str) -> dict:
    """The turn table of a step's turn from the workers' shards: their rows in row order, the shards' metadata (step,
    turn, K, d, sigma: equal in every shard, checked), as one worker would have written it."""
    import pyarrow as pa

    from artifacts import table_metadata, write_table

    out = {"stage": "gather-turn"}
    with timer(out):
        tables = [read_table(p) for p in shards]
        metas = [table_metadata(t) for t in tables]
        if any(m != metas[0] for m in metas[1:]):
            raise ValueError(f"turn shards disagree in their metadata: {metas}")
        table = pa.concat_tables(tables).sort_by("row")
        write_table(out_path, table.replace_schema_metadata(None), metadata=metas[0])
        out.update(path=out_path, rows=table.num_rows, shards=len(shards))
    return out


def place_groups(state_in: str, workers: int) -> dict[int, list[int]]:
    """Rows per worker: whole GRPO groups (a group stays on one worker for its episode: its prefix cache serves it),
    balanced by expected tokens (the group's prompt tokens: largest group first onto the least loaded worker; ties by
    group and worker index, so the placement is a function of the tasks table only)."""
    state = read_table(state_in)
    groups = state.column("group").to_pylist()
    lengths = [len(p) for p in state.column("prefix_ids").to_pylist()]
    members: dict[int, list[int]] = {}
    for row, g in enumerate(groups):
        members.setdefault(int(g), []).append(row)
    load = [0] * workers
    out: dict[int, list[int]] = {w: [] for w in range(workers)}
    for g in sorted(members, key=lambda g: (-sum(lengths[r] for r in members[g]), g)):
        w = min(range(workers), key=lambda w: (load[w], w))
        out[w] += members[g]
        load[w] += sum(lengths[r] for r in members[g])
    return {w: sorted(rows) for w, rows in out.items()}
