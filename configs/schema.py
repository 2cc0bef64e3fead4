"""The one run schema. Importable without torch (CI checks it).

Every field is documented; cross-field rules live in validators that say how to fix the input.
GRPO field names and defaults follow TRL's `GRPOConfig` (TRL 1.16) so users can carry settings over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CONFIG_DIR = Path(__file__).resolve().parent


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """The policy model. `tiny` builds a `Qwen3_5ForCausalLM` from `arch`; `pretrained` loads `path`."""

    source: Literal["tiny", "pretrained", "random"] = "tiny"
    path: str | None = Field(None, description="local checkpoint dir (source=pretrained)")
    arch: dict[str, Any] = Field(
        default_factory=dict,
        description="Qwen3_5TextConfig overrides (hidden_size, num_hidden_layers, layer_types, ...)",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype of the frozen base (bf16 on GPU; fp32 is faster on CPU)"
    )
    quantization: Literal["none", "nf4"] = "none"
    gdn_kernels: Literal["auto", "torch", "fla"] = Field(
        "auto", description="Gated DeltaNet kernels (engine/gdn.py): auto = fla's where they qualify against the "
                            "PyTorch reference on this GPU and these versions, the reference elsewhere (one log line "
                            "says which); torch = the reference always; fla = fla's or fail. Also the static "
                            "decoder's one-token GDN step (engine/gdn_step.py: gates + recurrent step in one kernel, "
                            "used where it qualifies unless torch)")
    adapter_kernels: Literal["auto", "torch"] = Field(
        "auto", description="the LoRA/DoRA epilogue (engine/adapter_kernels.py): auto = fused Triton kernels where "
                            "they qualify bit for bit against the PyTorch expressions on this GPU (one log line "
                            "otherwise), the PyTorch expressions on the CPU; torch = the PyTorch expressions always")
    adapter_step_kernels: Literal["auto", "torch"] = Field(
        "auto", description="the adapter term of single-token steps (latent loop and decode, at most 16 rows: "
                            "engine/adapter_kernels.py): auto = two Triton kernels for the whole term where they "
                            "qualify on this GPU -- within 1 BF16 ulp of the PyTorch path and as close to FP64, not bit "
                            "for bit (the sums run in another order than cuBLAS's) -- the PyTorch path on the CPU; "
                            "torch = the PyTorch path always (FP32 GEMMs and the epilogue above)")
    norm_kernels: Literal["auto", "torch"] = Field(
        "auto", description="the RMSNorms (engine/norm_kernels.py): auto = fused Triton kernels (forward and input "
                            "gradient) where they qualify on this GPU -- as accurate against FP64 as transformers' FP32 "
                            "expressions, not bit for bit theirs (one log line otherwise) -- transformers' expressions "
                            "on the CPU; torch = transformers' expressions always")
    attention_kernels: Literal["auto", "torch"] = Field(
        "auto", description="attention of short queries over the static K/V cache (latent loop and decode: "
                            "engine/attention_kernels.py): auto (default) = two Triton kernels reading the BF16 K/V in "
                            "place, FP32 softmax, P·V as exact products on tensor cores, where they qualify on this GPU "
                            "-- as accurate against FP64 as the FP32 PyTorch path, not bit for bit it (the sums run in "
                            "another order) -- the PyTorch path elsewhere (CPU; one log line); torch = the FP32 "
                            "PyTorch path always. On the H200: 16 layers 0.48 vs 5.13 ms at 4k positions, 27B latent "
                            "step 22.2 vs 26.9 ms (bench/results/h200-recipe-27b-nf4-kernels-2026-12-03.json)")
    nf4_kernels: Literal["auto", "torch"] = Field(
        "auto", description="NF4 projections of single-token steps (at most 16 rows, no gradient: "
                            "engine/nf4_kernels.py): auto (default) = one Triton kernel that dequantizes the 4-bit "
                            "weights in registers -- bit for bit bitsandbytes' dequantized values, products summed in "
                            "FP32 in another order than cuBLAS's -- where it qualifies on this GPU, bitsandbytes' "
                            "forward everywhere else (prefill, replay, CPU); torch = bitsandbytes' forward always. On "
                            "the H200: 24.7 vs 34.9 ms per step of the 27B model's 496 projections at 4 rows "
                            "(bench/results/h200-kernel-sweep-nf4-shuffle-2026-12-03.json)")
    init_seed: int = Field(0, description="seed of the random initialization (tiny / random)")
    attention_fp32: bool = Field(
        False, description="attention cores (QK^T, softmax, P·V) in FP32 in the trainer and the hf sampler, in every "
                           "layout (latent loop, decode, replay), output rounded once to `dtype`. In BF16 the latent "
                           "loop and replay then compute the same thought means far more often, and the per-step "
                           "thought density gap is gated (gates.thought_logq_gap_max). No effect in float32. On a GPU it needs "
                           "model.gdn_kernels: torch (fla's recurrent and chunked kernels round differently)")

    @model_validator(mode="after")
    def _arch(self) -> "ModelConfig":
        check_arch(self.arch)
        return self


# Qwen3_5TextConfig's own fields (transformers 5.17): the config class takes any keyword silently, so a misspelled
# arch key would otherwise build the default-sized model. Tokens ids are set by the project from the tokenizer.
ARCH_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "attention_bias", "attention_dropout", "head_dim",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "layer_types"})
ARCH_DEFAULTS = {"num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
                 "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                 "linear_value_head_dim": 128}  # Qwen3_5TextConfig's defaults for the keys the rules read
LAYER_TYPES = ("linear_attention", "full_attention")


def check_arch(arch: dict[str, Any]) -> None:
    """The architecture rules that otherwise fail minutes later inside a task (model build, GDN kernels)."""
    unknown = sorted(set(arch) - ARCH_KEYS)
    if unknown:
        hint = {"bos_token_id", "eos_token_id", "pad_token_id"} & set(unknown)
        raise ValueError(
            f"model.arch: unknown key(s) {unknown}"
            + (": token ids come from the tokenizer, drop them" if hint else
               f" (Qwen3_5TextConfig takes any name silently and would build its default instead); known keys: "
               f"{', '.join(sorted(ARCH_KEYS))}"))
    a = {**ARCH_DEFAULTS, **arch}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "max_position_embeddings"):
        v = arch.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"model.arch.{key}={v!r}: must be a positive integer")
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        if a[key] not in (64, 128):
            raise ValueError(f"model.arch.{key}={a[key]}: the Gated DeltaNet kernels (fla's, vLLM's CPU build) take "
                             "head dimensions 64 or 128 only; set 64 (small models) or 128 (the Qwen3.5 checkpoints)")
    if a["num_attention_heads"] % a["num_key_value_heads"]:
        raise ValueError(f"model.arch.num_attention_heads={a['num_attention_heads']} is not a multiple of "
                         f"num_key_value_heads={a['num_key_value_heads']} (grouped-query attention shares each KV head "
                         "among a whole number of query heads)")
    if a["linear_num_value_heads"] % a["linear_num_key_heads"]:
        raise ValueError(f"model.arch.linear_num_value_heads={a['linear_num_value_heads']} is not a multiple of "
                         f"linear_num_key_heads={a['linear_num_key_heads']} (Gated DeltaNet repeats each key head over a "
                         "whole number of value heads)")
    types = arch.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"model.arch.layer_types={types!r}: a list whose entries are {' or '.join(LAYER_TYPES)}")
        if len(types) != a["num_hidden_layers"]:
            raise ValueError(f"model.arch.layer_types lists {len(types)} layers but num_hidden_layers="
                             f"{a['num_hidden_layers']}: give one type per layer (or set num_hidden_layers: {len(types)})")


class TokenizerConfig(_Strict):
    """A byte-level BPE trained offline by the project on the built-in gym's oracle text."""

    path: str | None = Field(None, description="an HF tokenizer dir; None trains one into the run dir cache")
    vocab_size: int = Field(512, ge=300)


class AdapterConfig(_Strict):
    type: Literal["lora", "dora"] = "lora"
    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[str] = Field(
        default_factory=lambda: [
            "q_proj", "k_proj", "v_proj", "o_proj",
            "in_proj_qkv", "in_proj_z", "out_proj",
            "gate_proj", "up_proj", "down_proj",
        ],
        description="Linear module names (GDN: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj)",
    )
    train_final_norm: bool = Field(
        False, description="also train the model's final RMSNorm weight in full beside the adapter (PEFT "
                           "modules_to_save, an FP32 master like the adapter's; its LR is optimizer.final_norm_lr). "
                           "Its scale is how sharp the output distribution is: low-rank adapters under the final "
                           "norm cannot change it, so a policy sampled hotter than it is sure cannot sharpen without it. "
                           "The hf sampler only (vLLM's LoRA cannot load it)")

    @model_validator(mode="after")
    def _targets_are_linear(self) -> "AdapterConfig":
        if "conv1d" in self.targets:
            raise ValueError("adapter.targets: `conv1d` is a Conv1d, not a Linear; LoRA/DoRA cannot wrap it — remove it")
        if not self.targets:
            raise ValueError("adapter.targets is empty: name at least one Linear module, e.g. [q_proj, v_proj]")
        return self


class LatentConfig(_Strict):
    """Stochastic latent thoughts z = mu + sigma * eps, mu = g(h) (h mapped to the embedding scale)."""

    max_latent_steps: int = Field(4, ge=0, le=64)
    sigma: float = Field(0.05, gt=0, description="noise std, relative to the RMS of the embedding table")
    engine: Literal["auto", "trainer", "sampler"] = Field(
        "auto", description="the model that samples the thoughts: trainer (the policy as replay holds it, NF4 when "
                            "quantized) or sampler (the hf sampler's BF16 export of the same weights and adapter: one "
                            "prefill per row serves thoughts and answers, and single-token steps run cuBLAS BF16 "
                            "products instead of bitsandbytes' 4-bit kernels). auto: sampler when the base is NF4 "
                            "and the sampler is hf, else trainer (on an unquantized base both compute the same bits). "
                            "Replay scores the thoughts on the trainer either way")


class SamplerConfig(_Strict):
    kind: Literal["hf", "vllm"] = Field("hf", description="hf: the project's HF engine; vllm: in-process vLLM "
                                                          "(install with scripts/setup-vllm.sh)")
    temperature: float = Field(1.0, gt=0)
    max_answer_tokens: int = Field(48, ge=1)
    mtp_tokens: int = Field(0, ge=0, description="vLLM: MTP speculative tokens from the checkpoint's own head; 0 = off")
    prefix_caching: bool = Field(False, description="vLLM: cache prefixes (on hybrids: recurrent states at block "
                                                    "boundaries, an experimental vLLM mode)")
    attention_backend: str | None = Field(None, description="vLLM: pinned attention backend (None: FLASH_ATTN on "
                                                            "GPU, CPU_ATTN on CPU)")
    weights: Literal["export", "trainer"] = Field(
        "export", description="hf sampler: export = its own copy of the base (the export stage's; for an NF4 trainer "
                              "its dequantized BF16 weights: fast decode, but +54 GB at the 27B shape); trainer = the "
                              "trainer's own model, one copy of the base on the device (an NF4 27B step fits one 80 GB "
                              "GPU, as the first seed ran it; every decode step then goes through the NF4 kernels)")


class GenerationConfig(_Strict):
    """The generation fast path: prefix cache (CPU and GPU) and CUDA graphs (GPU)."""

    prefix_cache: bool = Field(
        True, description="per-row model states (attention K/V and GDN conv/recurrent states) keyed by token prefix: "
                          "a group's shared prompt and each turn's earlier tokens are computed once")
    prefix_cache_mb: int = Field(2048, ge=1, description="memory bound of each engine's prefix cache (LRU eviction)")
    cuda_graphs: bool = Field(True, description="device=cuda: latent loop and hf-sampler decode on a static cache "
                                                "with CUDA-graph replay (ignored on the CPU)")


class ReplayConfig(_Strict):
    """Replay memory policy (engine/replay.py): micro-batches of whole turns, tiers by cumulative tokens per device
    (graph kept -> activation checkpointing -> two-pass), and a preflight that refuses a plan that cannot fit."""

    microbatch_tokens: int | None = Field(
        None, ge=1, description="padded tokens (rows x longest turn) per micro-batch; a longer turn gets one of its "
                                "own, never split. None: auto_microbatch_tokens, lowered by the preflight to what fits")
    auto_microbatch_tokens: int = Field(8192, ge=1, description="the micro-batch size when microbatch_tokens is None")
    keep_graph_tokens: int | None = Field(
        None, ge=0, description="tier 1: the first this-many replayed tokens per device keep their whole autograd "
                                "graph until optimize (fastest, most memory). None: as many as the preflight finds room "
                                "for (all of them when there is no budget, e.g. on the CPU)")
    checkpoint_tokens: int | None = Field(
        None, ge=0, description="tier 2: cumulative tokens up to this count use activation checkpointing per decoder "
                                "layer (layer inputs kept, forward recomputed in backward); tokens beyond go two-pass "
                                "(scored without a graph, re-forwarded and back-propagated one micro-batch at a time in "
                                "optimize, checked bit for bit). None: as many as fit")
    checkpoint_keeps: Literal["inputs", "matmuls"] = Field(
        "inputs", description="what the checkpoint tier keeps besides each decoder layer's input. inputs: nothing "
                              "(the whole layer forward is recomputed in backward); matmuls: also the outputs of the "
                              "layer's wide matrix products (base projections, attention), so backward recomputes only "
                              "the cheap ops -- more memory per token (the preflight measures it), less recompute")
    memory_budget_gb: float | None = Field(
        None, gt=0, description="device memory the preflight plans for; None: memory_fraction of the GPU (no budget "
                                "on the CPU unless set here)")
    memory_fraction: float = Field(0.92, gt=0, le=1, description="share of the GPU's memory the preflight plans for")
    transient_share: float = Field(0.25, gt=0, le=1, description="auto micro-batch size: at most this share of the "
                                                                  "free memory in flight at once")
    token_costs_mb: dict[Literal["keep", "checkpoint", "transient"], float] | None = Field(
        None, description="bytes per token (MB) of the tiers, e.g. from bench/replay_27b.py; None: measured once per "
                          "engine on a GPU, estimated from the architecture elsewhere")
    logprob_chunk: int = Field(32768, ge=256, description="vocabulary rows per chunk of the selected-token log-probs "
                                                         "(never the full FP32 logits of a turn)")
    one_pass: bool = Field(
        False, description="back-propagate each micro-batch inside replay, right after its forward, with the loss "
                           "weights the driver will compute (its graph freed at once: kept whole if that fits in "
                           "flight, else checkpointed per checkpoint_keeps), instead of keeping graphs for optimize "
                           "or recomputing them there; optimize checks the weights bit for bit and re-forwards every "
                           "micro-batch if one differs. Exact for token-level losses, except on fresh steps with a "
                           "sequence-level importance correction unless the sampler's log-probs equal the trainer's "
                           "bit for bit. Off by default: at the 27B shape on the H200 it measured slower than the "
                           "tiers (README, 'Replay memory')")
    share_prefix: bool = Field(
        False, description="score each micro-batch's turns over their shared prefixes once (engine/shared_replay.py): "
                           "a row's earlier turn prefix and a group's prompt are forwarded once and every turn's "
                           "thoughts and answer branch from that state, with gradients through it; micro-batches hold "
                           "whole groups (or rows) and count their shared tokens. Same values up to rounding")
    adapter_forward: Literal["lean", "peft"] = Field(
        "lean", description="lean: PEFT's forward arithmetic with a backward that keeps only BF16 inputs and rank-r "
                            "FP32 intermediates (engine/adapter_grad.py); peft: PEFT's own autograd (FP32 input copies)")
    lora_product: Literal["fp32", "split"] = Field(
        "fp32", description="the lean forward's rank-r product h = A x. fp32: x cast to FP32 and an FP32 GEMM, PEFT's "
                            "arithmetic bit for bit. split: on a GPU, one BF16 tensor-core GEMM of x (BF16, exact) "
                            "with the FP32 A split in two BF16 halves, FP32 accumulation: within ~1e-5 of the FP32 "
                            "product, no FP32 copy of x (the backward's rank-r products already run so); elsewhere "
                            "the FP32 product. Needs adapter_forward: lean")

    @model_validator(mode="after")
    def _check(self) -> "ReplayConfig":
        if self.lora_product == "split" and self.adapter_forward != "lean":
            raise ValueError("replay.lora_product: split is a mode of the lean adapter forward; set "
                             "replay.adapter_forward: lean, or replay.lora_product: fp32")
        if self.token_costs_mb is not None and set(self.token_costs_mb) != {"keep", "checkpoint", "transient"}:
            raise ValueError("replay.token_costs_mb needs all of keep, checkpoint, transient (MB per token)")
        if self.one_pass and (self.keep_graph_tokens is not None or self.checkpoint_tokens is not None):
            raise ValueError("replay.one_pass keeps no graph across micro-batches, so replay.keep_graph_tokens and "
                             "replay.checkpoint_tokens (cumulative caps of kept graphs) do not apply: unset them, or "
                             "set replay.one_pass: false")
        if (self.keep_graph_tokens is not None and self.checkpoint_tokens is not None
                and self.checkpoint_tokens < self.keep_graph_tokens):
            raise ValueError(f"replay.checkpoint_tokens={self.checkpoint_tokens} is below replay.keep_graph_tokens="
                             f"{self.keep_graph_tokens}: it counts cumulative tokens, so set it >= keep_graph_tokens")
        return self


class FaultConfig(_Strict):
    """Fault injection in the project's tool server (tests and drills; off by default)."""

    rate: float = Field(0.0, ge=0, le=1, description="share of tool-server requests that get a fault")
    kinds: list[Literal["latency", "http_5xx", "timeout", "reset", "refused", "malformed"]] = Field(
        default_factory=lambda: ["latency", "http_5xx", "timeout", "reset", "refused", "malformed"])
    seed: int = 0


class ToolServerConfig(_Strict):
    """Remote tools: an HTTP tool server on 127.0.0.1 that the run starts (url None) or an existing one (url)."""

    url: str | None = Field(None, description="an already running tool server; None starts one per run")
    timeout_s: float = Field(10.0, gt=0, description="per attempt (connect + response)")
    max_attempts: int = Field(6, ge=1, description="attempts per call before a terminal ToolTransportError")
    backoff_base_s: float = Field(0.2, gt=0, description="exponential backoff base; full jitter")
    backoff_max_s: float = Field(10.0, gt=0)
    concurrency: int = Field(16, ge=1, description="episodes stepped in parallel by run-gym")
    faults: FaultConfig = FaultConfig()


class GymConfig(_Strict):
    name: str = Field("table", description="built-in gym name, or an import path `pkg.module:Factory`")
    max_turns: int = Field(6, ge=1)
    train_split_seed: int = 1234
    eval_tasks: int = Field(32, ge=1)
    token_budget: int = Field(
        8192, ge=1, description="tokens per episode: the model's answers plus every tool result (the question is free)")
    transport: Literal["local", "http"] = Field(
        "local", description="local: tools run in the driver; http: through the tool server (gym.tool_server)")
    tool_server: ToolServerConfig = ToolServerConfig()
    reward_funcs: list[str] = Field(
        default_factory=list,
        description="TRL-style reward functions `pkg.module:fn` with (prompts, completions, **kwargs) -> list[float], "
                    "called on finished episodes; their sum is added to the gym's reward")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the gym factory")

    @model_validator(mode="after")
    def _check(self) -> "GymConfig":
        bad = [f for f in self.reward_funcs if ":" not in f]
        if bad:
            raise ValueError(f"gym.reward_funcs: {bad} must be import paths like `my_pkg.rewards:fn`")
        if "tool_client" in self.options:
            raise ValueError("gym.options.tool_client is set by the driver; choose gym.transport: local | http instead")
        return self


class BootstrapConfig(_Strict):
    """Supervised warm start on the gym oracle's expert trajectories (cached, keyed by its config)."""

    enabled: bool = True
    episodes: int = Field(384, ge=1)
    epochs: int = Field(2, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(3e-3, gt=0)
    full_finetune: bool = Field(True, description="train the whole tiny base (True) or only an adapter")


class GRPOConfig(_Strict):
    """Names and defaults follow trl.GRPOConfig."""

    num_generations: int = Field(4, ge=2, description="group size")
    groups_per_step: int = Field(4, ge=1)
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo"] = "dapo"
    epsilon: float = Field(0.2, gt=0)
    epsilon_high: float | None = None
    delta: float | None = None
    max_log_ratio: float | None = Field(
        None, gt=0, description="clamp log(pi/pi_old) to [-m, m] before the exp (verl's guard, m=20 there); None: "
        "TRL's arithmetic, where one term more than 88.7 nat above its old value overflows and makes the gradient "
        "NaN (thought densities move by hundreds of nats on reuse steps at full width)")
    beta: float = 0.0
    negative_advantage_scale: float = Field(
        1.0, ge=0, description="multiplies the advantages below zero after group normalization (1: TRL's GRPO; "
        "0: only rollouts better than their group's mean are reinforced, the others get no gradient; between: "
        "weaker pushes away from worse-than-mean rollouts)")
    negative_token_max_prob: float | None = Field(
        None, gt=0, le=1, description="None: TRL's GRPO (a rollout's advantage on all its tokens). p: a below-mean "
        "rollout's (negative) advantage only on its answer tokens sampled with probability below p -- where it "
        "slipped -- so its correct tokens are not pushed down with them (thought terms keep the advantage)")
    importance_sampling_level: Literal["token", "sequence"] = "token"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    max_completion_length: int = Field(512, ge=1, description="dr_grpo normalizer")
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "sequence_mask"
    vllm_importance_sampling_clip_max: float = Field(3.0, gt=0)
    vllm_importance_sampling_clip_min: float | None = None
    thought_loss_weight: float = Field(1.0, ge=0, description="scale of the thought-density terms in the loss")
    thought_sampling_logq: Literal["replay", "recorded"] = Field(
        "replay", description=(
            "the thoughts' sampling log-density in the importance ratio. replay: the trainer's own replay value "
            "(thoughts are sampled by the trainer itself, so the vLLM-style correction covers the sampler's answer "
            "tokens only, as in TRL); recorded: the value the latent loop recorded, exact but numerically fragile: "
            "log q = -|z - mu|^2 / (2 sigma^2) turns BF16/NF4 rounding of mu between the generation and replay "
            "layouts into gaps of several nats per thought (measured 2-9 BF16, 9-18 NF4), which the sequence-level "
            "ratio multiplies into near-zero weights"))

    @model_validator(mode="after")
    def _check(self) -> "GRPOConfig":
        if self.beta != 0.0:
            raise ValueError("grpo.beta != 0 needs a reference model, which this trainer does not keep; set beta: 0.0")
        if self.loss_type == "cispo" and self.epsilon_high is None:
            raise ValueError("grpo.loss_type=cispo needs grpo.epsilon_high (TRL recommends 4.0 or 5.0)")
        return self


class OptimizerConfig(_Strict):
    lr: float = Field(5e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = Field(1.0, description="None disables clipping")
    final_norm_lr: float | None = Field(
        None, gt=0, description="AdamW's LR for the final norm's weight when adapter.train_final_norm (one shared "
                                "vector: Adam moves each entry by about this much per update); None: optimizer.lr. Unused "
                                "without adapter.train_final_norm")


class StepsConfig(_Strict):
    total: int = Field(20, ge=1)
    pattern: list[Literal["fresh", "reuse"]] = Field(
        default_factory=lambda: ["fresh"], description="repeated over the steps; must start with fresh"
    )

    @model_validator(mode="after")
    def _starts_fresh(self) -> "StepsConfig":
        if not self.pattern or self.pattern[0] != "fresh":
            raise ValueError("steps.pattern must start with `fresh`: a reuse step replays the rollouts of an earlier fresh step")
        return self

    def kind_of(self, step: int) -> str:
        return self.pattern[step % len(self.pattern)]


class GatesConfig(_Strict):
    """Seed thresholds. Configurable, but the defaults never move."""

    parity_mean_max: float = 0.1
    parity_token_max: float = 1.0
    parity_min_prob: float = 0.01
    require_nonzero_grad: bool = True
    thought_logq_gap_max: float = Field(
        32.0, gt=0, description="with model.attention_fp32: the most a step's recorded thought log-density may differ "
                                "from replay's under the same adapter (nat, max over its thoughts). Measured on the "
                                "tiny model in BF16 (d=128, 24 steps of up to 384 thoughts): healthy steps <= 6.0 "
                                "with the option (<= 8.7 without); replay under an adapter one update away: "
                                ">= 827. Re-measure for another width before relying on it")
    probe_every: int = Field(10, ge=1, description="teacher-forced probe every N steps (and after the last step)")
    probe_prompts: int = Field(8, ge=1, description="fixed held-out turns both engines score teacher-forced")
    probe_gap_max: float = Field(1.0, gt=0, description="max trainer-vs-sampler gap on a probe token (nat)")
    probe_layers_bitwise: bool = Field(
        True, description="with the hf sampler (same arithmetic as the trainer) every adapter layer's output must "
                          "match the trainer's bit for bit on the probe")
    verify_checkpoint: bool = Field(True, description="at the end of a run, reload the final adapter from disk "
                                                      "and re-score the probe: log-probs must be identical")


class RunConfig(_Strict):
    seed: int = 0
    run_dir: str = "runs/tiny"
    threads: int | None = Field(None, description="torch threads; None = all cores")
    workers: int = Field(0, ge=0, description="worker processes that generate turns (engine/pool.py: one per GPU on "
                                               "cuda, CPU processes here), started once per run; each GRPO group stays "
                                               "on one worker. 0: the engines run in the flow's own process")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the trainer and the hf sampler run")
    model: ModelConfig = ModelConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    adapter: AdapterConfig = AdapterConfig()
    latent: LatentConfig = LatentConfig()
    sampler: SamplerConfig = SamplerConfig()
    generation: GenerationConfig = GenerationConfig()
    replay: ReplayConfig = ReplayConfig()
    gym: GymConfig = GymConfig()
    bootstrap: BootstrapConfig = BootstrapConfig()
    grpo: GRPOConfig = GRPOConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    steps: StepsConfig = StepsConfig()
    gates: GatesConfig = GatesConfig()

    @model_validator(mode="after")
    def _cross(self) -> "RunConfig":
        s = self.sampler
        if s.kind == "vllm":
            if self.model.dtype != "bfloat16":
                raise ValueError("sampler.kind=vllm samples in bf16 (vLLM's Gated DeltaNet kernels need it): set "
                                 "model.dtype: bfloat16 so trainer and sampler compare like with like")
            if not 0.01 <= s.temperature <= 2.0:
                raise ValueError(f"sampler.temperature={s.temperature}: vLLM samples at temperatures in [0.01, 2] (it "
                                 "rejects larger ones and silently raises smaller ones to 0.01)")
        if s.mtp_tokens > 0 and s.prefix_caching and self.model_is_hybrid():
            raise ValueError(
                "sampler.mtp_tokens > 0 together with sampler.prefix_caching is rejected on a hybrid (Gated DeltaNet + "
                "attention) model: the prefix cache stores recurrent GDN states at block boundaries, and MTP verifies "
                "draft tokens and rolls rejected ones back, so a later turn that reuses a cached prefix can start from "
                "a recurrent state that does not match its tokens. Only the sampling log-probs show it, and in RL "
                "they enter the gradient (1-nat parity failures seen in a 27B run with both on). Turn one of them off.")
        if s.kind == "hf" and (s.mtp_tokens or s.prefix_caching or s.attention_backend):
            raise ValueError("sampler.mtp_tokens / prefix_caching / attention_backend are vLLM engine settings; the "
                             "hf sampler has none of them: remove them or set sampler.kind: vllm")
        if self.model.source == "pretrained" and not self.model.path:
            raise ValueError("model.source=pretrained needs model.path, the local checkpoint directory: e.g. --set "
                             "model.path=/path/to/Qwen3.5-27B (a Hugging Face snapshot with config.json and *.safetensors)")
        if self.model.source == "pretrained" and self.bootstrap.enabled:
            raise ValueError("model.source=pretrained trains the checkpoint as it is: the oracle warm-start is for the "
                             "project's tiny model (a real checkpoint needs none). Set bootstrap.enabled: false "
                             "(configs/pretrained.yaml does)")
        max_pos = self.model.arch.get("max_position_embeddings")
        if max_pos is not None and self.gym.token_budget + 256 > int(max_pos):
            raise ValueError(
                f"gym.token_budget={self.gym.token_budget} leaves no room for the question and the thoughts within "
                f"model.arch.max_position_embeddings={max_pos}: lower the budget to at most {int(max_pos) - 256}")
        if self.model.quantization == "nf4" and self.model.dtype != "bfloat16":
            raise ValueError("model.quantization=nf4 computes in bf16: set model.dtype: bfloat16")
        if self.model.quantization == "nf4" and self.device != "cuda":
            raise ValueError("model.quantization=nf4 runs through bitsandbytes' CUDA kernels: set device: cuda "
                             "(the CPU path keeps a bf16 or fp32 base)")
        if self.sampler.weights == "trainer" and self.sampler.kind != "hf":
            raise ValueError(f"sampler.weights=trainer samples answers on the trainer's own model, which only the hf "
                             f"sampler can do; sampler.kind={self.sampler.kind!r} loads its own weights: set "
                             f"sampler.kind: hf or sampler.weights: export")
        if self.latent.engine == "sampler" and self.sampler.kind != "hf":
            raise ValueError(f"latent.engine=sampler runs the latent loop on the hf sampler's model; sampler.kind="
                             f"{self.sampler.kind!r} has none: set latent.engine: trainer (or auto)")
        if self.model.attention_fp32 and self.device == "cuda" and self.model.gdn_kernels != "torch":
            raise ValueError(
                "model.attention_fp32 gates the thought-density gap, which needs the same arithmetic in the latent "
                "loop and in replay; on a GPU fla's GDN kernels are not (a single-token recurrent step against the "
                "chunked form: 38.3 nat on an H200 against 2.3 with the reference, bench/results/h200-thought-gap-"
                "2026-12-01.json). Set model.gdn_kernels: torch with it (slower replay), or turn attention_fp32 off")
        if self.adapter.train_final_norm and s.kind == "vllm":
            raise ValueError("adapter.train_final_norm trains the final norm's weight in full, which vLLM's LoRA "
                             "cannot load into its engine: set adapter.train_final_norm: false (--set "
                             "adapter.train_final_norm=false), or sampler.kind: hf")
        if self.replay.one_pass and self.workers:
            raise ValueError("replay.one_pass back-propagates inside replay in one process; with the worker pool "
                             f"(workers: {self.workers}) each worker keeps its graphs for optimize instead. Set "
                             "replay.one_pass: false, or workers: 0")
        return self

    def model_is_hybrid(self) -> bool:
        """Qwen3.5-family models are hybrids unless `arch.layer_types` lists no linear-attention layer."""
        types = self.model.arch.get("layer_types")
        return types is None or "linear_attention" in types

    def with_overrides(self, **dotted: Any) -> "RunConfig":
        """Return a copy with `a.b=value` overrides applied (validated again)."""
        data = self.model_dump()
        for key, value in dotted.items():
            _set_dotted(data, key, value)
        return RunConfig.model_validate(data)


class ConfigError(ValueError):
    """A config file or override that does not validate; the message says what to change."""


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        if p not in node or node[p] is None:
            node[p] = {}  # a section the file leaves at its defaults; validation rejects unknown names
        if not isinstance(node[p], dict):
            raise ConfigError(f"`{p}` in override `{key}` is a value, not a config section")
        node = node[p]
    node[parts[-1]] = value


def preset_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    cand = CONFIG_DIR / f"{name_or_path}.yaml"
    if cand.exists():
        return cand
    presets = ", ".join(sorted(x.stem for x in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config `{name_or_path}` not found: pass a YAML file path or a preset name ({presets})")


def load_config(name_or_path: str | Path = "tiny", overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a preset or YAML file; unknown keys and bad combinations raise ConfigError naming the fix."""
    path = preset_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, grpo:, ...)")
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key (check the spelling against configs/schema.py)"
            lines.append(f"  {loc or '<root>'}: {msg}")
        raise ConfigError(f"{path}: invalid config\n" + "\n".join(lines)) from None


def config_hash(cfg: BaseModel, *sections: str) -> str:
    """A stable hash of selected sections (or all), for cache keys of derived artifacts."""
    import hashlib
    import json

    data = cfg.model_dump(mode="json")
    if sections:
        data = {s: data[s] for s in sections}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
