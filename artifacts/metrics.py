"""The step metrics, declared once: which stage's summary each comes from, its TensorBoard tag, its CLI column.

flows/step.py:publish collects them into `<step>/metrics.json` and `<root>/metrics.jsonl`; artifacts/curves.py turns
them into TensorBoard scalars; `lgrpo train` prints them per step and in its final table. A new metric is one line
here (and its value in the stage's summary): nothing else needs an edit. Importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTED = "publish"  # a metric flows/step.py:publish computes across the step's stages (seconds, prefix cache)


@dataclass(frozen=True)
class StepMetric:
    name: str  # key in metrics.json / metrics.jsonl
    stage: str  # the stage whose summary carries it (COMPUTED: publish derives it)
    key: str | None = None  # its key in that summary (default: name)
    scalar: str | None = None  # TensorBoard tag
    column: str | None = None  # column of the CLI's per-step table (and its per-step line when `line`)
    fmt: str = "{}"
    line: bool = False

    @property
    def source_key(self) -> str:
        return self.key or self.name

    def format(self, record: dict) -> str:
        v = record.get(self.name)
        return "-" if v is None else self.fmt.format(v)


STEP_METRICS: tuple[StepMetric, ...] = (
    StepMetric("reward_mean", "collect-rollouts", scalar="train/reward", column="reward", fmt="{:.3f}", line=True),
    StepMetric("reward_std", "collect-rollouts"),
    StepMetric("success_rate", "collect-rollouts", scalar="train/success", column="success", fmt="{:.3f}", line=True),
    StepMetric("completion_rate", "collect-rollouts", scalar="train/completion"),
    StepMetric("tool_error_rate", "collect-rollouts"),
    StepMetric("mean_turns", "collect-rollouts"),
    StepMetric("answer_tokens", "collect-rollouts"),
    StepMetric("mean_tokens", "collect-rollouts"),
    StepMetric("tool_token_share", "collect-rollouts"),
    StepMetric("end_reasons", "collect-rollouts"),
    StepMetric("transport_retries", "collect-rollouts"),
    StepMetric("traces_verified", "collect-rollouts"),
    StepMetric("parity_mean", "replay", scalar="parity/mean", column="parity mean", fmt="{:.2e}"),
    StepMetric("parity_max", "replay", scalar="parity/max"),
    StepMetric("parity_masked", "replay", key="masked"),
    StepMetric("replay_tokens", "replay", key="tokens"),
    StepMetric("replay_plan", "replay", key="plan"),
    StepMetric("probe_max_gap", "probe", key="max_gap"),
    StepMetric("probe_argmax_agreement", "probe", key="argmax_agreement"),
    StepMetric("loss", "optimize", scalar="optim/loss", column="loss", fmt="{:+.4f}", line=True),
    StepMetric("grad_norm", "optimize", scalar="optim/grad_norm", column="grad norm", fmt="{:.3g}"),
    StepMetric("signal", "optimize"),
    StepMetric("updated", "optimize"),  # False: no signal in the batch, so AdamW did not step (adapter unchanged)
    StepMetric("live_graph", "optimize"),
    StepMetric("optimizer_kept", "optimize"),  # with workers: one flag per worker
    StepMetric("one_pass", "optimize"),  # replay.one_pass: True when replay's gradients stood, False if re-forwarded
    StepMetric("thought_logq_gap_max", "optimize"),
    StepMetric("backward_s", "optimize"),
    StepMetric("prepare_s", "optimize"),
    StepMetric("update_s", "optimize"),
    StepMetric("write_s", "optimize"),
    StepMetric("prefix_computed_share", COMPUTED, scalar="prefix_cache/computed_share", column="prefix computed",
               fmt="{:.0%}", line=True),
    StepMetric("stage_seconds", COMPUTED, scalar="seconds/step", column="seconds", fmt="{:.2f}"),
)


def from_summaries(by_stage: dict[str, dict]) -> dict:
    """The declared metrics a step's stage summaries carry ({stage: summary}), in declaration order."""
    out = {}
    for m in STEP_METRICS:
        s = by_stage.get(m.stage)
        if s is not None and m.source_key in s:
            out[m.name] = s[m.source_key]
    return out


def scalars(record: dict) -> dict[str, float | None]:
    """TensorBoard scalars of one metrics record: the declared tags, and seconds per phase."""
    out: dict[str, float | None] = {m.scalar: record.get(m.name) for m in STEP_METRICS if m.scalar}
    for phase, sec in (record.get("phases") or {}).items():
        out[f"seconds/{phase}"] = sec
    return out


def columns() -> list[StepMetric]:
    return [m for m in STEP_METRICS if m.column]


def line(record: dict) -> str:
    """The per-step line `lgrpo train` prints: `reward=0.487 success=0.000 loss=-0.0418 prefix computed=29%`."""
    return " ".join(f"{m.column}={m.format(record)}" for m in STEP_METRICS if m.line and record.get(m.name) is not None)
