"""Later denoising steps as one fixed-shape function: eager, ``torch.compile``'d, or replayed as a CUDA graph.

After the prefill every later step of a generation has the same shapes: the response ids (B, L) go through each
layer, write their keys and values into the response slot of that layer's cache buffer (whose address never
changes) and attend to ``kept + L`` keys. Only the rows whose logits the sampler needs change from step to step,
so the fixed part runs the last layer on a fixed window of rows (the current block: its start is an input
tensor) and the LM head is applied to the needed rows outside it. That costs the last layer a whole block
instead of its still-masked rows (a fraction of one layer) and buys a function that compiles once and can be
captured as one CUDA graph: one launch per step instead of a few per layer.

Both run the engine's one step (``engine.step.step_hidden``, one lane); the eager path (the needed rows only)
stays the default; these modes are opt-in (``maskkv bench speed --step-modes compile,cuda-graph`` or ``--compile``,
and the library's ``StepOptions``) and need the whole model on one device. Every call runs on the buffer the setup
ran on (``static_in``, the response copied in): a compiled step never sees other strides than those it was
compiled for (a batch's response is a strided view of its sequence), so it never recompiles inside a timed step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from maskkv_cli.engine.lanes import StepLane
from maskkv_cli.engine.step import step_hidden
from maskkv_cli.errors import UsageError
from maskkv_cli.kv.cache import PromptCache
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.runtime.stats import now


@dataclass(frozen=True)
class StepOptions:
    """How later steps run: ``compile`` wraps them in ``torch.compile``; ``cuda_graph`` replays a captured graph."""

    compile: bool = False
    cuda_graph: bool = False

    @property
    def eager(self) -> bool:
        return not (self.compile or self.cuda_graph)

    @property
    def label(self) -> str:
        parts = [name for name, on in (("compile", self.compile), ("cuda-graph", self.cuda_graph)) if on]
        return "+".join(parts) or "eager"

    @classmethod
    def from_label(cls, label: str) -> StepOptions:
        """``eager``, ``compile``, ``cuda-graph`` or ``compile+cuda-graph`` (the inverse of ``label``)."""
        parts = set(label.split("+"))
        if not parts <= {"compile", "cuda-graph"} and label != "eager":
            raise UsageError(f"unknown step mode {label!r}; use one of {', '.join(STEP_MODES)}")
        return cls(compile="compile" in parts, cuda_graph="cuda-graph" in parts)


STEP_MODES = ("eager", "compile", "cuda-graph", "compile+cuda-graph")


class StepRunner:
    """Runs later steps for one prompt cache; building it (compilation, capture) happens once, timed as
    ``setup_s`` so that callers can keep it out of the step figures."""

    def __init__(self, model: DiffusionLM, cache: PromptCache, response: Tensor, options: StepOptions,
                 row_window: int | None = None, rope_factor: float = 1.0) -> None:
        """``row_window``: every call's rows lie in one aligned window of this many rows (the sampler's block);
        None runs the last layer on all rows."""
        if model.layer_devices and len(set(model.layer_devices)) > 1:
            raise UsageError(f"the {options.label} step mode needs the whole model on one device; drop --device-map "
                             "or run the eager mode")
        if options.cuda_graph and model.config.moe is not None:  # its routing counts each expert's rows on the host
            raise UsageError(f"the {options.label} step mode cannot capture a mixture-of-experts model (its routing "
                             "reads each expert's row count on the host); run the eager or compile mode")
        if options.cuda_graph and response.device.type != "cuda":
            raise UsageError(f"the {options.label} step mode needs a CUDA device, the model is on "
                             f"{response.device.type}")
        self.model, self.cache, self.options = model, cache, options
        dev = response.device
        t0 = now(dev)
        length = response.shape[1]
        self.window = row_window if row_window and row_window < length else None
        every_row = torch.arange(length, device=dev)

        def body(ids: Tensor, window: Tensor | None) -> Tensor:
            rows = every_row if window is None else window
            (hidden,) = step_hidden(model, [StepLane(ids, rows, cache.prompt_len, cache, rope_factor=rope_factor)])
            return hidden

        self.body: Callable[[Tensor, Tensor | None], Tensor] = (
            torch.compile(body, dynamic=False) if options.compile else body)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in = response.clone()
        self.static_window = None if self.window is None else torch.arange(self.window, device=dev)
        self.static_out: Tensor | None = None
        if options.cuda_graph:
            self._capture()
        else:
            self.body(self.static_in, self.static_window)  # compiles now, not in a timed step (writes the slot)
        self.setup_s = now(dev) - t0

    def _capture(self) -> None:
        # on the model's own GPU: the streams and the capture otherwise follow the current device (cuda:0), while
        # the kernels of a model on cuda:N run on that device's stream and the capture would record nothing
        with torch.cuda.device(self.static_in.device):
            side = torch.cuda.Stream(device=self.static_in.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up (and compilation) outside the capture, as CUDA graphs require
                    self.body(self.static_in, self.static_window)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_out = self.body(self.static_in, self.static_window)

    def __call__(self, response: Tensor, rows: Tensor, start: int | None = None) -> Tensor:
        """Logits (B, len(rows), V) at response rows ``rows`` (ascending) for the response ids (B, L).

        ``start``: the first row of the window that holds ``rows`` (the sampler's block start, known on the host);
        when None it is read from ``rows`` (a device sync), which must then lie in one aligned window.
        """
        rows = rows.to(response.device)
        window = None
        if self.window is not None:
            if start is None:
                first, last = rows[[0, -1]].tolist()
                start = first // self.window * self.window
                if last >= start + self.window:
                    raise ValueError(f"rows {first}..{last} span more than one window of {self.window}")
            window = torch.arange(start, start + self.window, device=response.device)
            rows = rows - start
        self.static_in.copy_(response)
        if self.graph is not None:
            if window is not None and self.static_window is not None:
                self.static_window.copy_(window)
            self.graph.replay()
            hidden = self.static_out
            assert hidden is not None
        else:
            hidden = self.body(self.static_in, window)
        return self.model.head(hidden[:, rows])
