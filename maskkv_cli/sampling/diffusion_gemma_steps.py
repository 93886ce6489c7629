"""DiffusionGemma's sampler as pure step functions, and a reference driver that runs them without KV compression.

The steps are those of transformers' ``generation_diffusion_gemma.py`` (spec section 4), written over tensors;
``denoising_loop`` runs them as a generator of requests, which ``sampling/diffusion_gemma.py`` hands to the driver:

- ``random_canvas``: the initial canvas, uniform ids in [0, V) drawn with ``torch.randint`` from a generator; a
  CPU generator seeded s gives the canvas transformers draws after ``torch.manual_seed(s)``;
- ``temperature`` / ``temper``: the linear schedule ``T = t_min + (t_max - t_min) * cur_step / N``, where
  ``cur_step`` counts the steps *remaining* (N at the first step, 1 at the last);
- ``sample_canvas``: one multinomial draw per position from ``softmax(logits / T)``;
- ``token_entropy`` / ``entropy_bound_accept``: accept the lowest-entropy positions while the sum of the
  accepted entropies minus the largest of them stays within ``entropy_bound`` (the lowest one always);
- ``renoise``: every position not accepted gets a fresh random id (nothing stays frozen across steps);
- ``stable_and_confident``: a row stops denoising when its argmax canvas equals that of the previous
  ``stability_threshold`` steps and the mean entropy of its tempered logits is below ``confidence_threshold``;
- ``hold_finished``: rows that stopped keep their argmax, canvas and logits while the others go on;
- ``finalize_canvas``: the EOS rule after a canvas is committed: a row with an EOS in its new canvas is finished
  and its tokens after the first EOS become pad; rows finished earlier get an all-pad canvas.

Random numbers are drawn in transformers' order, so one generator reproduces a whole ``generate``: per canvas one
``randint`` (the initial canvas); per step one ``multinomial`` over (B C, V), then one ``randint`` (B, C) for
the renoising. ``generate_reference`` is the whole loop over ``models.diffusion_gemma.DiffusionGemma``: it
commits the *argmax* canvas of the last step run (not the sampled one) and returns whole canvases.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from maskkv_cli.errors import UsageError
from maskkv_cli.models.diffusion_gemma import DiffusionGemma, PromptCache


@dataclass(frozen=True)
class DiffusionGemmaSampling:
    """The sampler's settings; the defaults are transformers' (and the released ``generation_config.json``'s,
    except the EOS and pad ids, which the model's generation config supplies: [1, 106, 50] and 0 there)."""

    max_new_tokens: int = 256  # rounded up to whole canvases
    max_denoising_steps: int = 48  # N
    t_min: float = 0.4  # the temperature at the last step (cur_step -> 0)
    t_max: float = 0.8  # the temperature at the first step
    entropy_bound: float = 0.1
    stability_threshold: int | None = 1  # None (with confidence_threshold None): no adaptive stopping
    confidence_threshold: float | None = 0.005
    eos_token_ids: tuple[int, ...] | None = None  # None: no EOS rule (transformers without eos in its config)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0 or self.max_denoising_steps <= 0:
            raise UsageError("DiffusionGemma sampling: max_new_tokens and max_denoising_steps must be positive")
        if self.t_min < 0 or self.t_max <= self.t_min:
            raise UsageError(f"DiffusionGemma sampling: need 0 <= t_min < t_max (got {self.t_min}, {self.t_max})")
        if self.entropy_bound <= 0:
            raise UsageError("DiffusionGemma sampling: entropy_bound must be > 0")
        if self.stability_threshold is not None and self.stability_threshold < 0:
            raise UsageError("DiffusionGemma sampling: stability_threshold must be >= 0")
        if self.confidence_threshold is not None and self.confidence_threshold <= 0:
            raise UsageError("DiffusionGemma sampling: confidence_threshold must be > 0")

    @property
    def adaptive_stopping(self) -> bool:
        return self.stability_threshold is not None and self.confidence_threshold is not None


# ----- the steps -------------------------------------------------------------------------------------------------

def random_canvas(batch_size: int, canvas_length: int, vocab_size: int, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu") -> Tensor:
    """(B, C) uniform ids in [0, vocab_size)."""
    return torch.randint(0, vocab_size, (batch_size, canvas_length), generator=generator, device=device)


def temperature(cur_step: int, max_denoising_steps: int, t_min: float, t_max: float) -> Tensor:
    """The 0-dim fp32 temperature at ``cur_step`` steps remaining, computed as transformers does (the step as an
    int32 tensor, so in fp32)."""
    step = torch.tensor(cur_step, dtype=torch.int32)
    return t_min + (t_max - t_min) * (step / max_denoising_steps)


def temper(raw: Tensor, cur_step: int, settings: DiffusionGemmaSampling) -> Tensor:
    """The processed logits ``raw / T`` (B, C, V) of the step with ``cur_step`` steps remaining."""
    t = temperature(cur_step, settings.max_denoising_steps, settings.t_min, settings.t_max)
    return raw / t.to(raw.device)


def sample_canvas(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per position from ``softmax(logits)`` (B, C, V) -> (B, C)."""
    b, c, v = logits.shape
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.multinomial(probs.view(-1, v), num_samples=1, generator=generator).view(b, c)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy (B, C) of ``softmax(logits)`` per position, computed as ``torch.distributions.Categorical`` does
    (so that the acceptance below is decided on the same numbers)."""
    logp = logits - logits.logsumexp(dim=-1, keepdim=True)  # (B, C, V)
    p = F.softmax(logp, dim=-1)
    return -(logp.clamp(min=torch.finfo(logp.dtype).min) * p).sum(-1)


def entropy_bound_accept(logits: Tensor, entropy_bound: float) -> Tensor:
    """(B, C) bool: the positions accepted this step. Sorted by entropy, the prefix whose entropy sum minus its
    largest entropy stays within the bound (an upper bound on the accepted tokens' mutual information)."""
    entropy = token_entropy(logits)
    ordered, order = torch.sort(entropy, dim=-1, descending=False)
    chosen = torch.cumsum(ordered, dim=-1) - ordered <= entropy_bound  # (B, C), in sorted order
    return torch.scatter(torch.zeros_like(chosen), -1, order, chosen)


def accept(current: Tensor, sampled: Tensor, accepted: Tensor) -> Tensor:
    """The sampled ids where accepted, the current ones elsewhere (B, C)."""
    return torch.where(accepted, sampled, current)


def renoise(canvas: Tensor, accepted: Tensor, noise: Tensor) -> Tensor:
    """Fresh ids (``noise``, B, C) on every position not accepted."""
    return torch.where(~accepted, noise, canvas)


def stable_and_confident(argmax: Tensor, logits: Tensor, history: Tensor | None, stability_threshold: int,
                         confidence_threshold: float) -> tuple[Tensor, Tensor | None]:
    """(stop (B,) bool, the new history): a row stops when its ``argmax`` canvas (B, C) equals those of the last
    ``stability_threshold`` steps (``history`` (S, B, C), None at a canvas's first step: no step matches) and the
    mean entropy of its tempered ``logits`` is below ``confidence_threshold``."""
    if stability_threshold == 0:
        stable = torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device)
    else:
        if history is None:
            history = torch.full((stability_threshold, *argmax.shape), -1, dtype=argmax.dtype, device=argmax.device)
        stable = (history == argmax[None]).all(dim=-1).all(dim=0)
        history = torch.cat((history[1:], argmax[None]))  # the oldest out, this step in
    confident = token_entropy(logits).mean(dim=-1) < confidence_threshold
    return stable & confident, history


def hold_finished(finished: Tensor, old: Tensor, new: Tensor) -> Tensor:
    """``new`` where a row is still denoising, ``old`` in rows that stopped (``finished`` (B,))."""
    return torch.where(finished.view(-1, *([1] * (new.dim() - 1))), old, new)


def finalize_canvas(sequences: Tensor, finished: Tensor, canvas_length: int, eos_token_ids: tuple[int, ...] | None,
                    pad_token_id: int | None) -> tuple[Tensor, Tensor]:
    """The EOS rule after a canvas was appended to ``sequences`` (B, L): (sequences, finished (B,)).

    A row with an EOS in its last ``canvas_length`` tokens finishes; with a pad id, rows finished before get an
    all-pad canvas and tokens after a row's first EOS become pad (as transformers' ``_finalize_canvas``)."""
    sequences = sequences.clone()
    now = torch.zeros_like(finished)
    eos = None
    if eos_token_ids:
        eos = torch.tensor(eos_token_ids, device=sequences.device)
        now = torch.isin(sequences[:, -canvas_length:], eos).any(dim=-1)
    before, finished = finished, finished | now
    if pad_token_id is not None and bool(finished.any()):
        sequences[before, -canvas_length:] = pad_token_id
        if eos is not None and bool(now.any()):
            new = sequences[:, -canvas_length:]  # a view: written in place
            is_eos = torch.isin(new, eos)
            seen = is_eos.cumsum(dim=-1)
            new[(seen > 0) & ~((seen == 1) & is_eos)] = pad_token_id  # everything after the first EOS
    return sequences, finished


# ----- one step over the model --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepResult:
    canvas: Tensor  # (B, C) the next step's input canvas (accepted ids, the rest renoised)
    argmax: Tensor  # (B, C) the argmax of this step's tempered logits (what a canvas commits)
    logits: Tensor  # (B, C, V) this step's tempered logits (the next step's self-conditioning signal)
    sampled: Tensor  # (B, C) the multinomial draw
    accepted: Tensor  # (B, C) bool
    finished: Tensor  # (B,) rows that stopped denoising (this step or before)
    history: Tensor | None  # the stability history after this step


def denoising_step(model: DiffusionGemma, cache: PromptCache, canvas: Tensor, argmax: Tensor,
                   self_conditioning: Tensor | None, cur_step: int, finished: Tensor, history: Tensor | None,
                   settings: DiffusionGemmaSampling, generator: torch.Generator | None = None) -> StepResult:
    """One decoder pass and the sampler's step on it (transformers' ``_denoising_step``): ``canvas`` (B, C) is the
    current canvas, ``argmax`` the previous step's argmax, ``self_conditioning`` the previous step's tempered
    logits (None at the first step), ``finished`` the rows that stopped."""
    raw = model.decode(canvas, cache, self_conditioning)  # (B, C, V) fp32
    return step_on_logits(raw, canvas, argmax, self_conditioning, cur_step, finished, history, settings,
                          model.gemma.vocab_size, model.dtype, generator)


def step_on_logits(raw: Tensor, canvas: Tensor, argmax: Tensor, self_conditioning: Tensor | None, cur_step: int,
                   finished: Tensor, history: Tensor | None, settings: DiffusionGemmaSampling, vocab_size: int,
                   dtype: torch.dtype, generator: torch.Generator | None = None) -> StepResult:
    """The sampler's step on the decoder's raw logits (B, C, V) of ``canvas``: ``denoising_step`` without the
    model (for loops that have their logits computed elsewhere, e.g. over a compressed cache); ``dtype`` is the
    embedding's, the dtype the self-conditioning signal goes back in."""
    logits = temper(raw, cur_step, settings)
    sampled = sample_canvas(logits, generator)
    new_argmax = logits.argmax(dim=-1)
    accepted = entropy_bound_accept(logits, settings.entropy_bound)
    noise = random_canvas(*canvas.shape, vocab_size, generator, canvas.device)
    new_canvas = renoise(accept(canvas, sampled, accepted), accepted, noise)
    if settings.adaptive_stopping:
        if bool(finished.any()):  # rows that stopped keep what they had
            new_argmax = hold_finished(finished, argmax, new_argmax)
            new_canvas = hold_finished(finished, canvas, new_canvas)
            logits = hold_finished(finished, self_conditioning.float(), logits)  # type: ignore[union-attr]
        stop, history = stable_and_confident(new_argmax, logits, history, settings.stability_threshold,  # type: ignore[arg-type]
                                             settings.confidence_threshold)  # type: ignore[arg-type]
        finished = finished | stop
    # the signal goes back in the embedding's dtype, as upstream casts it; clamped to that dtype's range first, so
    # that greedy's tempered logits (about 1e7 at t = 1e-6) stay finite in fp16 (inf there made the next softmax NaN;
    # in bf16 and fp32 the clamp changes nothing)
    finite = torch.finfo(dtype)
    signal = logits.clamp(finite.min, finite.max).to(dtype)
    return StepResult(new_canvas, new_argmax, signal, sampled, accepted, finished, history)


# ----- the loop and the reference driver ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeRequest:
    """One decoder pass: the raw logits (B, C, V) of ``canvas`` are sent back."""

    canvas: Tensor  # (B, C)
    self_conditioning: Tensor | None  # the previous step's tempered logits; None at a canvas's first step


@dataclass(frozen=True)
class CommitRequest:
    """A finished canvas's tokens (B, C) join the cache; None is sent back."""

    tokens: Tensor


@dataclass(frozen=True)
class LoopOutput:
    sequences: Tensor  # (B, P + n C): the prompt and n whole canvases
    decoder_passes: Tensor  # (B,) decoder passes counted per row (as transformers' tokens_per_forward counts them)
    steps: tuple[int, ...]  # denoising steps run per canvas


GemmaLoop = Generator[DecodeRequest | CommitRequest, Tensor | None, LoopOutput]
Forward = Callable[[DecodeRequest | CommitRequest], Tensor | None]


def denoising_loop(prompt_ids: Tensor, vocab_size: int, canvas_length: int, dtype: torch.dtype,
                   settings: DiffusionGemmaSampling, generator: torch.Generator | None = None) -> GemmaLoop:
    """The whole sampler, canvas after canvas, as a generator: it yields the decoder passes and commits it needs
    (answered by a forward: ``generate_reference``'s over the full cache, ``CompressingForward``, in
    ``diffusion_gemma_forward.py``, over a compressed one) and returns the output. The random draws come in
    transformers' order."""
    b, c, device = prompt_ids.shape[0], canvas_length, prompt_ids.device
    sequences = prompt_ids
    finished_rows = torch.zeros(b, dtype=torch.bool, device=device)
    passes = torch.zeros(b, dtype=torch.int64, device=device)
    steps: list[int] = []
    for canvas_index in range(-(-settings.max_new_tokens // c)):
        if canvas_index:
            yield CommitRequest(sequences[:, -c:])
        canvas = random_canvas(b, c, vocab_size, generator, device)
        argmax, signal, history = canvas, None, None
        done = torch.zeros(b, dtype=torch.bool, device=device)
        run = 0
        for cur_step in range(settings.max_denoising_steps, 0, -1):
            passes += ~(done | finished_rows)
            raw = yield DecodeRequest(canvas, signal)
            assert raw is not None
            step = step_on_logits(raw, canvas, argmax, signal, cur_step, done, history, settings, vocab_size, dtype,
                                  generator)
            canvas, argmax, signal, done, history = step.canvas, step.argmax, step.logits, step.finished, step.history
            run += 1
            if bool(done.all()):
                break
        steps.append(run)
        sequences, finished_rows = finalize_canvas(torch.cat((sequences, argmax), dim=-1), finished_rows, c,
                                                   settings.eos_token_ids, settings.pad_token_id)
        if bool(finished_rows.all()):
            break
    return LoopOutput(sequences, passes, tuple(steps))


def drive_loop(loop: GemmaLoop, forward: Forward) -> LoopOutput:
    """Run a loop to its end, each request answered by ``forward``."""
    try:
        request = next(loop)
        while True:
            request = loop.send(forward(request))
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


class FullCacheForward:
    """Answers a loop's requests over the full prompt cache: decodes over it, commits append to it."""

    def __init__(self, model: DiffusionGemma, prompt_ids: Tensor, canvases: int = 1) -> None:
        """``canvases``: how many the loop may run (the full layers keep room for all but the last to join the
        cache, and for the decoder's canvas)."""
        spare = canvases * model.gemma.canvas_length
        self.model, self.cache = model, model.encode(prompt_ids, spare=spare).cache

    def __call__(self, request: DecodeRequest | CommitRequest) -> Tensor | None:
        if isinstance(request, CommitRequest):
            self.cache = self.model.commit(self.cache, request.tokens)
            return None
        return self.model.decode(request.canvas, self.cache, request.self_conditioning)


def generate_reference(model: DiffusionGemma, prompt_ids: Tensor, settings: DiffusionGemmaSampling | None = None,
                       generator: torch.Generator | None = None, seed: int | None = None) -> LoopOutput:
    """Canvas after canvas with the full prompt cache (no compression): transformers' ``generate`` for a batch of
    equal-length, unpadded prompts (B, P). ``seed`` makes a CPU generator (the same numbers as
    ``torch.manual_seed(seed)`` before transformers' ``generate``); without either, the global generator."""
    settings = settings or DiffusionGemmaSampling()
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    loop = denoising_loop(prompt_ids, model.gemma.vocab_size, model.gemma.canvas_length, model.dtype, settings,
                          generator)
    canvases = -(-settings.max_new_tokens // model.gemma.canvas_length)
    return drive_loop(loop, FullCacheForward(model, prompt_ids, canvases))
