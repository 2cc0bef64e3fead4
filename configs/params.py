"""The train flow's parameters as a pydantic model: Prefect builds the deployment's run form from it (one field per
commonly changed setting, with its description and bounds) and validates a run's parameters before the flow starts.
Every field maps to a dotted config setting; `overrides` takes any other one. The whole combination is validated like
a config file (configs/schema.py), so a bad value fails at once with the schema's fix-it message. Torch-free."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.schema import ConfigError, load_config

# parameter -> dotted config key
SETTINGS = {"steps": "steps.total", "run_dir": "run_dir", "seed": "seed", "threads": "threads", "device": "device",
            "learning_rate": "optimizer.lr", "groups_per_step": "grpo.groups_per_step",
            "num_generations": "grpo.num_generations", "loss_type": "grpo.loss_type",
            "temperature": "sampler.temperature", "max_latent_steps": "latent.max_latent_steps",
            "eval_tasks": "gym.eval_tasks"}


class TrainParameters(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    config: str = Field("tiny", description="preset name (configs/*.yaml: tiny, tiny-research, qwen35-27b, ...) or a "
                                            "YAML path")
    steps: int | None = Field(None, ge=1, description="GRPO steps (steps.total); empty: the preset's")
    run_dir: str | None = Field(None, description="run directory; an existing one resumes; empty: the preset's")
    seed: int | None = Field(None, description="run seed (tasks, thoughts, samples); empty: the preset's")
    threads: int | None = Field(None, ge=1, description="torch threads; empty: the preset's (all cores)")
    device: Literal["cpu", "cuda"] | None = Field(None, description="where the trainer and hf sampler run")
    learning_rate: float | None = Field(None, gt=0, description="AdamW learning rate (optimizer.lr)")
    groups_per_step: int | None = Field(None, ge=1, description="GRPO groups per fresh step (grpo.groups_per_step)")
    num_generations: int | None = Field(None, ge=2, description="rollouts per group (grpo.num_generations)")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo"] | None = Field(
        None, description="TRL loss type (grpo.loss_type; cispo needs epsilon_high in overrides)")
    temperature: float | None = Field(None, gt=0, description="sampling temperature (sampler.temperature)")
    max_latent_steps: int | None = Field(None, ge=0, description="latent thoughts per turn; 0 disables them")
    eval_tasks: int | None = Field(None, ge=1, description="held-out tasks evaluated before and after training")
    overrides: dict[str, Any] = Field(default_factory=dict, description="any other setting as dotted keys, e.g. "
                                                                        "{\"grpo.epsilon_high\": 5.0}")

    @model_validator(mode="after")
    def _valid_config(self) -> "TrainParameters":
        clash = sorted(set(self.overrides) & {SETTINGS[k] for k in SETTINGS if getattr(self, k) is not None})
        if clash:
            raise ValueError(f"overrides {clash} repeat a named parameter: set it once")
        try:
            load_config(self.config, self.config_overrides())
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return self

    def config_overrides(self) -> dict[str, Any]:
        """The dotted overrides these parameters stand for (named parameters, then `overrides`)."""
        named = {SETTINGS[k]: getattr(self, k) for k in SETTINGS if getattr(self, k) is not None}
        return {**named, **self.overrides}
