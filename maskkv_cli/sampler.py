"""The LLaDA denoising loop (the reference sampler) over either the plain forward or the compressed cache.

Sequence = ``[prompt ; gen_length masks]``. Blocks are decoded left to right; ``steps`` is split evenly over
blocks; in a block with m masked tokens and s steps, step j commits ``m // s`` tokens (the first ``m % s``
steps one more), chosen by confidence (``low_confidence``: probability of the chosen token; ``random``:
uniform noise). Temperature uses Gumbel noise in float64; classifier-free guidance runs a second sequence
with the prompt masked. With ``threshold`` set, every masked token of the block whose confidence exceeds it
is committed at once (always at least one). Progress goes to ``on_event`` as plain ``Event`` objects.
Each committed token's probability under the model (after guidance, before noise) at the step it was
unmasked goes to ``GenerationResult.token_probs``; it takes no part in choosing tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from maskkv_cli.engine.cache import PromptCache
from maskkv_cli.engine.forward import LayerRecord, plain_logits, prefill, response_logits
from maskkv_cli.engine.step_runner import StepOptions, StepRunner
from maskkv_cli.errors import UsageError
from maskkv_cli.models.families import DiffusionLM
from maskkv_cli.policies.base import Policy
from maskkv_cli.stats import RunStats, memory_now, model_devices, now, reset_cuda_peaks

REMASKING = ("low_confidence", "random")


@dataclass(frozen=True)
class GenerationConfig:
    gen_length: int = 128
    steps: int = 128
    block_length: int = 32
    temperature: float = 0.0
    cfg_scale: float = 0.0
    remasking: str = "low_confidence"
    threshold: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.gen_length <= 0 or self.block_length <= 0 or self.steps <= 0:
            raise UsageError("--gen-length, --block-length and --steps must be positive")
        if self.gen_length % self.block_length:
            raise UsageError(f"--gen-length {self.gen_length} must be a multiple of --block-length "
                             f"{self.block_length}")
        if self.steps % self.n_blocks:
            raise UsageError(f"--steps {self.steps} must be a multiple of the number of blocks {self.n_blocks} "
                             f"(gen length / block length)")
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")
        if self.cfg_scale < 0:
            raise UsageError(f"--cfg must be >= 0, got {self.cfg_scale}")
        if self.remasking not in REMASKING:
            raise UsageError(f"--remasking must be one of {', '.join(REMASKING)}")
        if self.threshold is not None and not 0.0 <= self.threshold < 1.0:
            raise UsageError(f"--threshold must be in [0, 1), got {self.threshold}")

    @property
    def n_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.n_blocks


@dataclass(frozen=True)
class Event:
    """Progress of a generation, for displays. ``kind``: prefill, step, done."""

    kind: str
    block: int = 0
    n_blocks: int = 0
    step: int = 0  # global step index (0 = the prefill)
    committed: int = 0  # tokens committed by this step
    masked_left: int = 0
    elapsed_s: float = 0.0


@dataclass
class GenerationResult:
    tokens: Tensor  # (B, gen_length) response ids (cond batch only)
    stats: RunStats
    records: list[LayerRecord] = field(default_factory=list)
    layer_budgets: list[int] | None = None
    # (B, gen_length) float64: probability of each token when it was committed (NaN: never committed)
    token_probs: Tensor | None = None


def transfer_schedule(masked: int, steps: int) -> list[int]:
    """Tokens to commit at each of ``steps`` steps for ``masked`` masked tokens (reference rule)."""
    base, rem = divmod(masked, steps)
    return [base + (1 if j < rem else 0) for j in range(steps)]


def add_gumbel_noise(logits: Tensor, temperature: float, gen: torch.Generator | None) -> Tensor:
    """Reference sampling trick: exp(logits) / (-log u)^T in float64; temperature 0 returns logits."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=gen)
    return logits.exp() / (-torch.log(u)) ** temperature


class _Forward:
    """Step 0 and later steps for one policy: plain recompute, or prefill + response-only steps.

    With a logit shift (Dream: position i is predicted from hidden state i - 1) the cached segment is the
    prompt minus its last token, which runs with the response at every step so that the first response
    position gets fresh logits.
    """

    def __init__(self, model: DiffusionLM, policy: Policy, budget: int | None, prompt_len: int,
                 online_importance: bool = False, step_options: StepOptions | None = None,
                 row_window: int | None = None) -> None:
        self.model, self.policy, self.prompt_len = model, policy, prompt_len
        self.online = online_importance
        self.step_options = step_options or StepOptions()
        self.runner: StepRunner | None = None
        self.setup_s = 0.0  # time spent building the runner (compilation / capture), not a step's work
        self.row_window = row_window  # the sampler's block: each later step's rows lie in one such window
        self.shift = model.config.logit_shift
        self.split = prompt_len - self.shift  # cached prompt segment [0, split)
        self.cache: PromptCache | None = None
        self.records: list[LayerRecord] = []
        self.layer_budgets: list[int] | None = None
        self.batch = 1
        if policy.uses_cache and self.split < 1:
            raise UsageError("the prompt is too short for a prefix cache; use --policy none")
        if policy.evicts and budget is not None and budget < self.split:
            self.layer_budgets = policy.layer_budgets(len(model.blocks), budget, self.split)

    def __call__(self, x: Tensor, rows: Tensor, block_start: int | None = None) -> Tensor:
        """Logits for response positions ``rows`` of the sequence x (B, M + L); ``block_start``: the first
        position of the ``row_window`` block that holds them, when the caller knows it."""
        self.batch = x.shape[0]
        hidden = rows + self.prompt_len - self.shift  # sequence index of the hidden state feeding each row
        if not self.policy.uses_cache:
            logits = plain_logits(self.model, x, hidden)
        elif self.cache is None:
            logits, self.cache, self.records = prefill(self.model, x, self.split, self.policy, self.layer_budgets,
                                                       hidden, online_importance=self.online)
            if self.online and self.layer_budgets is not None:
                self.layer_budgets = [r.layer_budget for r in self.records]  # the plan actually used
            if not self.step_options.eager:
                self.runner = StepRunner(self.model, self.cache, x[:, self.split :], self.step_options,
                                         self.row_window)
                self.setup_s = self.runner.setup_s
        elif self.runner is not None:
            logits = self.runner(x[:, self.split :], hidden - self.split, block_start)
        else:
            logits = response_logits(self.model, self.cache, x[:, self.split :], hidden - self.split)
        return logits.to(x.device)  # a model spread over devices ends on its last one


@torch.no_grad()
def generate(
    model: DiffusionLM,
    prompt: Tensor,
    gen: GenerationConfig,
    policy: Policy,
    budget: int | None = None,
    on_event: Callable[[Event], None] | None = None,
    online_importance: bool = False,
    step_options: StepOptions | None = None,
) -> GenerationResult:
    """Denoise ``gen.gen_length`` tokens after ``prompt`` (B, M) with ``policy`` at ``budget``.

    ``online_importance``: layer budgets from the current input (the full cache is resident during the prefill).
    ``step_options``: run later steps compiled or as a CUDA graph (``engine/step_runner.py``).
    """
    device = model.device
    x, m = masked_sequence(model, prompt, gen.gen_length)
    bsz, mask_id = x.shape[0], model.config.mask_token_id
    rng = torch.Generator(device=device).manual_seed(gen.seed)
    forward = _Forward(model, policy, budget, m, online_importance, step_options, gen.block_length)
    log = StepLog(model, RunStats(policy=policy.name, prompt_len=m, gen_length=gen.gen_length), on_event, m, forward)
    token_probs = torch.full((bsz, gen.gen_length), float("nan"), dtype=torch.float64, device=device)
    for blk in range(gen.n_blocks):
        lo, hi = blk * gen.block_length, (blk + 1) * gen.block_length
        block_masked = x[:, m + lo : m + hi] == mask_id  # (B, block)
        schedules = [transfer_schedule(int(c), gen.steps_per_block) for c in block_masked.sum(1)]
        j = 0
        while True:
            masked = x[:, m + lo : m + hi] == mask_id
            if not bool(masked.any()) or (gen.threshold is None and j >= gen.steps_per_block):
                break
            t0 = now(device)
            rows = lo + torch.nonzero(masked.any(0)).flatten()  # response positions whose logits are needed
            xin = x
            if gen.cfg_scale > 0:
                un = x.clone()
                un[:, :m] = mask_id
                xin = torch.cat([x, un], 0)
            logits = forward(xin, rows, lo)  # (B', n, V)
            if gen.cfg_scale > 0:
                cond, unc = logits.chunk(2, 0)
                logits = unc + (gen.cfg_scale + 1) * (cond - unc)
            if mask_id < logits.shape[-1]:  # never "commit" the mask token itself (random or tiny models can)
                logits[..., mask_id] = float("-inf")
            x0 = add_gumbel_noise(logits, gen.temperature, rng).argmax(-1)  # (B, n)
            chosen_prob = logits.to(torch.float64).softmax(-1).gather(-1, x0[..., None]).squeeze(-1)
            if gen.remasking == "low_confidence":
                conf = chosen_prob
            else:
                conf = torch.rand(x0.shape, dtype=torch.float64, device=device, generator=rng)
            still = x[:, m + rows] == mask_id  # (B, n)
            conf = torch.where(still, conf, float("-inf"))
            if gen.threshold is None:
                counts = [schedules[b][j] for b in range(bsz)]
            else:  # parallel decoding: everything above the threshold, at least one per row
                counts = [max(1, int((conf[b] > gen.threshold).sum())) for b in range(bsz)]
            commit = top_k_commit(conf, still, counts)
            x[:, m + rows] = torch.where(commit, x0, x[:, m + rows])
            token_probs[:, rows] = torch.where(commit, chosen_prob, token_probs[:, rows])
            log.step(t0, x, commit, blk, gen.n_blocks)
            j += 1
    log.done()
    return GenerationResult(x[:, m:].clone(), log.stats, forward.records, forward.layer_budgets, token_probs)


def masked_sequence(model: DiffusionLM, prompt: Tensor, gen_length: int) -> tuple[Tensor, int]:
    """``[prompt ; gen_length masks]`` on the model's device (a 1-D prompt is one row) and the prompt length."""
    if prompt.dim() == 1:
        prompt = prompt[None]
    prompt = prompt.to(model.device)
    bsz, m = prompt.shape
    if m == 0:
        raise UsageError("the prompt is empty")
    masks = torch.full((bsz, gen_length), model.config.mask_token_id, dtype=prompt.dtype, device=prompt.device)
    return torch.cat([prompt, masks], 1), m


def top_k_commit(conf: Tensor, still: Tensor, counts: list[int]) -> Tensor:
    """Bool (B, n): the ``counts[b]`` most confident still-masked positions of each row."""
    commit = torch.zeros_like(still)
    for b, k in enumerate(counts):
        k = min(k, int(still[b].sum()))
        if k:
            commit[b, conf[b].topk(k).indices] = True
    return commit


class StepLog:
    """Times the steps (device-synchronised), emits events, and fills the run statistics at the end."""

    def __init__(self, model: DiffusionLM, stats: RunStats, on_event: Callable[[Event], None] | None,
                 prompt_len: int, forward: _Forward) -> None:
        self.model, self.stats, self.prompt_len, self.forward = model, stats, prompt_len, forward
        self.emit = on_event or (lambda e: None)
        self.device = model.device
        self.steps = 0
        reset_cuda_peaks(model_devices(model))
        self.start = now(self.device)
        stats.step_mode = forward.step_options.label

    def step(self, t0: float, x: Tensor, commit: Tensor, block: int, n_blocks: int) -> None:
        t1 = now(self.device)
        setup = self.forward.setup_s  # one-time compilation / capture inside step 0: not the step's work
        if self.steps == 0:
            self.stats.prefill_s = t1 - t0 - setup
        else:
            self.stats.step_s.append(t1 - t0)
        left = int((x[:, self.prompt_len :] == self.model.config.mask_token_id).sum())
        self.emit(Event("prefill" if self.steps == 0 else "step", block, n_blocks, self.steps, int(commit.sum()),
                        left, t1 - self.start - setup))
        self.steps += 1

    def done(self) -> None:
        """End-of-run figures: time, memory, KV bytes kept vs what the full prompt cache would take."""
        stats, cfg, forward = self.stats, self.model.config, self.forward
        stats.setup_s = forward.setup_s
        stats.total_s = now(self.device) - self.start - forward.setup_s
        stats.steps_run = self.steps
        _, stats.peak_mem_bytes, stats.mem_kind = memory_now(model_devices(self.model))
        if forward.cache is not None:
            stats.kv_entries = forward.cache.logical_entries()
            stats.kv_bytes = forward.cache.prompt_nbytes()
        elt = torch.finfo(self.model.dtype).bits // 8
        per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * elt  # type: ignore[operator]
        stats.kv_full_bytes = per_token * forward.split * forward.batch
        self.emit(Event("done", 0, 0, self.steps, 0, 0, stats.total_s))
